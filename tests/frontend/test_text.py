"""scheduler_svc.frontend: tokenizer and chat template match transformers; streaming detokenization and stop strings."""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys

import jinja2
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scheduler_svc.frontend import DetokenizeResult, IncrementalDetokenizer, Tokenizer
from scheduler_svc.frontend.tokenizer import FinalMessageError

TEXTS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "  leading and trailing spaces  ",
    "naïve café, Straße, Ελληνικά, русский",
    "日本語のテキストと中文文本",
    "emoji: 🎉🚀👩‍👩‍👧 and flags 🇫🇷",
    "def f(x):\n\tif x:\n        return [i ** 2 for i in range(x)]\n\n\n    # tabs\tand  spaces\r\n",
    "",
    "<|im_start|>user\nspecial tokens in text<|im_end|>",
]
CONVERSATIONS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [{"role": "system", "content": "You are terse."},
     {"role": "user", "content": "Name a color 🎨."},
     {"role": "assistant", "content": "Blue."},
     {"role": "user", "content": "Another, in 日本語?"}],
]
LONG_TEXT = ("In 1492, Columbus sailed the ocean blue. 東京は日本の首都です。 Emoji time: 🎉🚀🔥👍🏽 — "
             "naïve façade; def main():\n    return {'ok': True}\n") * 4
HYP = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def hf(default_model):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(default_model))


# --- tokenizer vs transformers ---


def test_encode_decode_match_transformers(tok, hf):
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == hf(text)["input_ids"], text
        assert tok.encode(text, add_special_tokens=False) == hf(text, add_special_tokens=False)["input_ids"]
        for skip in (True, False):
            assert tok.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)
        assert tok.convert_ids_to_tokens(ids) == hf.convert_ids_to_tokens(ids)
        assert [tok.id_to_token(i) for i in ids] == hf.convert_ids_to_tokens(ids)


def test_vocab_and_special_tokens_match_transformers(tok, hf):
    assert tok.vocab_size == len(hf) == 49152
    assert tok.eos_token_ids == (2,) == (hf.eos_token_id,)
    assert (tok.bos_token, tok.eos_token) == (hf.bos_token, hf.eos_token)
    assert tok.all_special_ids == frozenset(hf.all_special_ids) | set(hf.added_tokens_decoder)
    assert tok.convert_ids_to_tokens([0, 1, 2, 42], skip_special_tokens=True) == \
        hf.convert_ids_to_tokens([0, 1, 2, 42], skip_special_tokens=True)


@pytest.mark.parametrize("conv", CONVERSATIONS)
@pytest.mark.parametrize("gen_prompt", [True, False])
def test_chat_template_matches_transformers(tok, hf, conv, gen_prompt):
    text = tok.apply_chat_template(conv, add_generation_prompt=gen_prompt)
    assert text == hf.apply_chat_template(conv, tokenize=False, add_generation_prompt=gen_prompt)
    ref_ids = hf.apply_chat_template(conv, tokenize=True, add_generation_prompt=gen_prompt, return_dict=False)
    assert tok.encode(text, add_special_tokens=False) == ref_ids
    assert tok.encode_chat(conv, add_generation_prompt=gen_prompt) == ref_ids


CONTINUED = [  # conversations whose final message continue_final_message leaves open
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello, I"}],
    [*CONVERSATIONS[1], {"role": "assistant", "content": "Sure: "}],  # its trailing space stays
    [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hello"}],  # the content twice: the last
    [{"role": "user", "content": "Complete this: the sky is"}],  # a user's message (transformers checks no role)
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": ""}],
]


@pytest.mark.parametrize("conv", CONTINUED)
def test_continue_final_message_ends_inside_it_as_transformers_does(tok, hf, conv):
    given = json.dumps(conv)
    text = tok.apply_chat_template(conv, add_generation_prompt=False, continue_final_message=True)
    assert text == hf.apply_chat_template(conv, tokenize=False, add_generation_prompt=False,
                                          continue_final_message=True)
    assert text.endswith(conv[-1]["content"])
    ref_ids = hf.apply_chat_template(conv, tokenize=True, add_generation_prompt=False, continue_final_message=True,
                                     return_dict=False)
    assert tok.encode_chat(conv, add_generation_prompt=False, continue_final_message=True) == ref_ids
    assert json.dumps(conv) == given  # the caller's messages are left as they were


# A template that trims each content and renders documents (as RAG templates do)
TRIMMING = ("{% for d in documents or [] %}<doc>{{ d['title'] }}: {{ d['text'] }}</doc>\n{% endfor %}"
            "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] | trim }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
DOCUMENTS = [{"title": "Paris", "text": "The capital of France."}, {"title": "Oslo", "text": "Norway's."}]


def _with_template(model_dir, template: str) -> Tokenizer:
    t = Tokenizer.from_model_dir(model_dir)
    t.chat_template = template
    return t


def test_continue_final_message_under_a_template_that_trims_and_documents_reach_it(default_model, hf):
    ours = _with_template(default_model, TRIMMING)
    conv = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "  Hello, I  "}]
    text = ours.apply_chat_template(conv, add_generation_prompt=False, continue_final_message=True,
                                    documents=DOCUMENTS)
    assert text == hf.apply_chat_template(conv, chat_template=TRIMMING, tokenize=False, add_generation_prompt=False,
                                          continue_final_message=True, documents=DOCUMENTS)
    assert text.startswith("<doc>Paris: The capital of France.</doc>\n") and text.endswith("assistant\nHello, I")
    assert ours.encode_chat(conv, add_generation_prompt=False, continue_final_message=True, documents=DOCUMENTS) \
        == hf.apply_chat_template(conv, chat_template=TRIMMING, tokenize=True, add_generation_prompt=False,
                                  continue_final_message=True, documents=DOCUMENTS, return_dict=False)


def test_continue_final_message_refuses_what_it_cannot_continue(tok, default_model):
    conv = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello, I"}]
    with pytest.raises(ValueError, match="add_generation_prompt"):
        tok.apply_chat_template(conv, add_generation_prompt=True, continue_final_message=True)
    with pytest.raises(FinalMessageError, match="no text content"):
        tok.apply_chat_template([*conv[:1], {"role": "assistant", "content": None}], add_generation_prompt=False,
                                continue_final_message=True)
    clipping = _with_template(default_model,
                              "{% for m in messages %}{{ m['role'] }}: {{ m['content'][:4] }}\n{% endfor %}")
    with pytest.raises(FinalMessageError, match="does not render the final message's content"):
        clipping.encode_chat(conv, add_generation_prompt=False, continue_final_message=True)


def _bos_post_processor() -> dict:
    """Llama 3's kind: BOS (here <|im_start|>, id 1) before the text, nothing after."""
    seq = [{"SpecialToken": {"id": "<|im_start|>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}]
    return {"type": "TemplateProcessing", "single": seq, "pair": seq + [{"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {"<|im_start|>": {"id": "<|im_start|>", "ids": [1], "tokens": ["<|im_start|>"]}}}


def test_add_special_tokens_puts_the_tokenizers_bos_before_a_rendered_chat_as_transformers_does(default_model,
                                                                                                  tmp_path):
    from transformers import AutoTokenizer
    d = _copy_dir(default_model, tmp_path)
    _edit_json(d / "tokenizer.json", post_processor=_bos_post_processor())
    _edit_json(d / "tokenizer_config.json", add_bos_token=None)
    ours, ref = Tokenizer.from_model_dir(d), AutoTokenizer.from_pretrained(str(d))
    conv = CONVERSATIONS[1]
    text = ref.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
    with_bos = ours.encode_chat(conv, add_special_tokens=True)
    assert with_bos == ref(text, add_special_tokens=True)["input_ids"] and with_bos[:2] == [1, 1]  # the template's too
    assert ours.encode_chat(conv) == ref.apply_chat_template(conv, tokenize=True, add_generation_prompt=True,
                                                             return_dict=False) == with_bos[1:]


def _copy_dir(model_dir, tmp_path, skip=("model.safetensors",)):
    for f in model_dir.iterdir():
        if f.name not in skip:
            shutil.copy(f, tmp_path / f.name)
    return tmp_path


def _edit_json(path, **changes):
    data = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            data.pop(key, None)
        else:
            data[key] = value
    path.write_text(json.dumps(data))


def _bos_eos_post_processor() -> dict:
    def special(token, ids):
        return {"id": token, "ids": ids, "tokens": [token]}
    seq = [{"SpecialToken": {"id": "<|im_start|>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
           {"SpecialToken": {"id": "<|im_end|>", "type_id": 0}}]
    return {"type": "TemplateProcessing", "single": seq, "pair": seq + [{"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {"<|im_start|>": special("<|im_start|>", [1]), "<|im_end|>": special("<|im_end|>", [2])}}


@pytest.mark.parametrize("flags", [{"add_bos_token": True, "add_eos_token": True},
                                   {"add_bos_token": None, "add_eos_token": None}])
def test_bos_eos_from_tokenizer_json_post_processor_match_transformers(default_model, tmp_path, flags):
    from transformers import AutoTokenizer
    d = _copy_dir(default_model, tmp_path)
    _edit_json(d / "tokenizer.json", post_processor=_bos_eos_post_processor())
    _edit_json(d / "tokenizer_config.json", **flags)
    ours, ref = Tokenizer.from_model_dir(d), AutoTokenizer.from_pretrained(str(d))
    for text in ("Hello there", "", "🎉"):
        ids = ours.encode(text)
        assert ids == ref(text)["input_ids"]
        assert ids[0] == 1 and ids[-1] == 2 and 1 not in ids[1:-1]  # never twice
        assert ours.encode(text, add_special_tokens=False) == ref(text, add_special_tokens=False)["input_ids"]


def test_add_bos_token_in_tokenizer_config_is_respected(default_model, tmp_path):
    # NOTE: transformers 5 ignores these flags when tokenizer.json exists (its post-processor decides);
    # transformers 4 (and so vLLM on it) applied them. We follow the config, which is what the model expects.
    from transformers import AutoTokenizer
    d = _copy_dir(default_model, tmp_path)
    _edit_json(d / "tokenizer_config.json", add_bos_token=True)
    ours, ref = Tokenizer.from_model_dir(d), AutoTokenizer.from_pretrained(str(d))
    assert ours.encode("Hello there") == [1] + ref("Hello there")["input_ids"]
    _edit_json(d / "tokenizer_config.json", add_bos_token=False, add_eos_token=True)
    assert Tokenizer.from_model_dir(d).encode("Hello there") == ref("Hello there")["input_ids"] + [2]


def test_eos_ids_fall_back_from_generation_config_to_config_to_tokenizer_config(default_model, tmp_path):
    d = _copy_dir(default_model, tmp_path)
    _edit_json(d / "generation_config.json", eos_token_id=[2, 0, 2])
    assert Tokenizer.from_model_dir(d).eos_token_ids == (2, 0)
    (d / "generation_config.json").unlink()
    _edit_json(d / "config.json", eos_token_id=0)
    assert Tokenizer.from_model_dir(d).eos_token_ids == (0,)
    _edit_json(d / "config.json", eos_token_id=None)
    assert Tokenizer.from_model_dir(d).eos_token_ids == (2,)  # "<|im_end|>" from tokenizer_config.json


def test_chat_template_from_tokenizer_config_and_template_helpers(default_model, tmp_path):
    d = _copy_dir(default_model, tmp_path)
    (d / "chat_template.jinja").unlink()
    template = ("{% if messages[0]['role'] == 'bad' %}{{ raise_exception('no bad roles') }}{% endif %}"
                "{{ bos_token }}{% for m in messages %}\n  {{ m['content'] | tojson }}\n{% endfor %}{{ eos_token }}")
    _edit_json(d / "tokenizer_config.json", chat_template=template)
    t = Tokenizer.from_model_dir(d)
    # trim_blocks/lstrip_blocks drop the newline after a block tag and the indentation before one.
    assert t.apply_chat_template([{"role": "user", "content": "é"}]) == '<|im_start|>  "é"\n<|im_end|>'
    with pytest.raises(jinja2.TemplateError, match="no bad roles"):
        t.apply_chat_template([{"role": "bad", "content": "x"}])
    _edit_json(d / "tokenizer_config.json", chat_template="{{ messages.__class__.__mro__ }}")
    with pytest.raises(jinja2.exceptions.SecurityError):
        Tokenizer.from_model_dir(d).apply_chat_template([])
    _edit_json(d / "tokenizer_config.json", chat_template=None)
    with pytest.raises(ValueError, match="no chat template"):
        Tokenizer.from_model_dir(d).apply_chat_template([])


def test_importing_text_package_leaves_torch_and_transformers_out():
    code = ("import sys, scheduler_svc.frontend; "
            "print(sorted(m for m in ('torch', 'cupy', 'transformers', 'grpc') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    assert out.strip() == "[]"


# --- incremental detokenization ---


def _stream(det: IncrementalDetokenizer, chunks) -> tuple[list[str], DetokenizeResult | None]:
    deltas, last = [], None
    for chunk in chunks:
        last = det.push(chunk)
        deltas.append(last.text_delta)
        if last.stopped:
            return deltas, last
    last = det.flush()
    deltas.append(last.text_delta)
    return deltas, last


def _chunks(ids, sizes):
    out, i = [], 0
    for n in sizes:
        out.append(ids[i:i + n])
        i += n
    out.append(ids[i:])
    return out


def test_stream_of_real_text_holds_back_split_characters(tok):
    prompt = tok.encode_chat([{"role": "user", "content": "Say something."}])
    ids = tok.encode(LONG_TEXT, add_special_tokens=False)
    det = IncrementalDetokenizer(tok, prompt)
    deltas, _ = _stream(det, [[i] for i in ids])
    assert "".join(deltas) == tok.decode(ids) == LONG_TEXT
    assert not any("\ufffd" in d for d in deltas)
    # Emoji and CJK characters span several byte tokens: some steps must have held their text back.
    assert sum(d == "" for d in deltas) > 10


def test_push_decodes_a_small_window_not_the_whole_output(tok):
    class Counting:
        widest = 0

        def decode(self, ids, skip_special_tokens=True):
            Counting.widest = max(Counting.widest, len(ids))
            return tok.decode(ids, skip_special_tokens)

    ids = tok.encode(LONG_TEXT * 3, add_special_tokens=False)
    det = IncrementalDetokenizer(Counting(), tok.encode("A prompt of a few words here"))
    deltas, _ = _stream(det, [[i] for i in ids])
    assert "".join(deltas) == LONG_TEXT * 3
    assert len(ids) > 300 and Counting.widest <= 8


@HYP
@given(ids=st.lists(st.integers(0, 49151), max_size=40), prompt=st.lists(st.integers(0, 49151), max_size=8),
       sizes=st.lists(st.integers(0, 4), max_size=20), skip=st.booleans())
def test_deltas_concatenate_to_decode_for_random_ids(tok, ids, prompt, sizes, skip):
    det = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
    deltas, _ = _stream(det, _chunks(ids, sizes))
    assert "".join(deltas) == tok.decode(ids, skip_special_tokens=skip)


@HYP
@given(text=st.text(max_size=40), prefix=st.text(max_size=10), sizes=st.lists(st.integers(0, 3), max_size=30))
def test_deltas_concatenate_to_decode_for_random_unicode(tok, text, prefix, sizes):
    ids = tok.encode(text, add_special_tokens=False)
    det = IncrementalDetokenizer(tok, tok.encode(prefix))
    deltas, _ = _stream(det, _chunks(ids, sizes))
    full = tok.decode(ids)
    assert "".join(deltas) == full
    # NOTE: `full` is not always `text`: this vocab lacks 21 byte tokens (e.g. 0x04, 0xF1), and BPE without an
    # unk token drops them silently, as transformers does too.
    if "\ufffd" not in full:
        assert not any("\ufffd" in d for d in deltas)


def test_flush_emits_a_trailing_incomplete_character(tok):
    ids = tok.encode("ok 🎉", add_special_tokens=False)[:-1]  # drop the emoji's last byte token
    det = IncrementalDetokenizer(tok, [])
    pushed = det.push(ids).text_delta
    assert pushed == "ok"
    assert pushed + det.flush().text_delta == tok.decode(ids)
    assert tok.decode(ids).endswith("\ufffd")


def test_special_tokens_kept_or_skipped(tok):
    ids = tok.encode("Hi<|im_end|>", add_special_tokens=False)
    assert ids[-1] == 2
    for skip in (True, False):
        deltas, _ = _stream(IncrementalDetokenizer(tok, [], skip_special_tokens=skip), [[i] for i in ids])
        assert "".join(deltas) == ("Hi" if skip else "Hi<|im_end|>")


# --- stop strings ---


class CharDecoder:
    """One token per character (id = code point): the stop-string logic sees exactly the pushed characters."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(map(chr, ids))


def _expected_stop(text: str, stops) -> tuple[str, str | None]:
    hits = [(text.find(s) + len(s), text.find(s), s) for s in stops if s in text]
    if not hits:
        return text, None
    _, start, stop = min(hits)
    return text[:start], stop


def _char_stream(text: str, stops, sizes=None):
    det = IncrementalDetokenizer(CharDecoder(), [], stop=stops)
    ids = [ord(c) for c in text]
    return _stream(det, _chunks(ids, sizes) if sizes is not None else [[i] for i in ids])


def test_stop_string_spanning_pushes_is_cut_and_not_emitted():
    deltas, last = _char_stream("Hello END world", ["END"])
    assert "".join(deltas) == "Hello "
    assert last == DetokenizeResult("", True, "END")
    # While "EN" could still become "END", it was held back, never sent.
    assert not any("E" in d for d in deltas)


def test_stop_string_at_the_very_start():
    deltas, last = _char_stream("STOP and more", ["STOP"])
    assert deltas == ["", "", "", ""] and last.stopped and last.stop_string == "STOP"


def test_false_start_of_stop_string_is_released():
    det = IncrementalDetokenizer(CharDecoder(), [], stop=["abc"])
    assert det.push(map(ord, "xab")).text_delta == "x"
    assert det.push([ord("d")]).text_delta == "abd"
    assert det.push(map(ord, "a")).text_delta == ""
    assert det.flush() == DetokenizeResult("a")  # finished for another reason: the held text goes out


def test_overlapping_and_multiple_stop_strings_first_completed_wins():
    # "bc" completes before "abcd" does, even though "abcd" starts earlier.
    assert "".join(_char_stream("xabcdy", ["abcd", "bc"])[0]) == "xa"
    # Both complete at the same character: the longer one (starting earlier) cuts more.
    deltas, last = _char_stream("xabcy", ["bc", "abc"])
    assert "".join(deltas) == "x" and last.stop_string == "abc"
    # Independent stop strings: the earliest in the text wins, whatever their order in the list.
    deltas, last = _char_stream("one two three", ["three", "two"])
    assert "".join(deltas) == "one " and last.stop_string == "two"
    # Self-overlapping stop string: "aab" inside "aaab".
    assert "".join(_char_stream("xaaab", ["aab"])[0]) == "xa"


def test_include_stop_str_ends_the_text_with_the_stop_string_and_nothing_after_it():
    for sizes in (None, [3, 2, 4, 20]):  # one character a push, and pushes that split the stop string
        det = IncrementalDetokenizer(CharDecoder(), [], stop=["END", "xyz"], include_stop_str=True)
        ids = [ord(c) for c in "Hello END world"]
        deltas, last = _stream(det, _chunks(ids, sizes) if sizes is not None else [[i] for i in ids])
        assert "".join(deltas) == "Hello END" and last.stopped and last.stop_string == "END"


def test_push_after_stop_and_empty_stop_rejected():
    det = IncrementalDetokenizer(CharDecoder(), [], stop=["!"])
    assert det.push(map(ord, "hi!there")) == DetokenizeResult("hi", True, "!")
    assert det.push(map(ord, "more")) == DetokenizeResult("", True, "!")
    assert det.flush() == DetokenizeResult("", True, "!")
    with pytest.raises(ValueError):
        IncrementalDetokenizer(CharDecoder(), [], stop=[""])


@HYP
@given(text=st.text(alphabet="ab c", max_size=30),
       stops=st.lists(st.text(alphabet="ab c", min_size=1, max_size=4), min_size=1, max_size=3),
       sizes=st.lists(st.integers(0, 5), max_size=12))
def test_stop_strings_do_not_depend_on_push_boundaries(text, stops, sizes):
    want_text, want_stop = _expected_stop(text, stops)
    det = IncrementalDetokenizer(CharDecoder(), [], stop=stops)
    sent = ""
    for chunk in _chunks([ord(c) for c in text], sizes):
        res = det.push(chunk)
        sent += res.text_delta
        assert want_text.startswith(sent)  # nothing past (or of) the stop string is ever sent
        if res.stopped:
            break
    else:
        res = det.flush()
        sent += res.text_delta
    assert (sent, res.stop_string, res.stopped) == (want_text, want_stop, want_stop is not None)


def test_stop_string_over_real_multibyte_tokens(tok):
    text = "Réponse: 答案是 42 🎉 fin. Extra text after."
    ids = tok.encode(text, add_special_tokens=False)
    for stops, want in ((["🎉"], "Réponse: 答案是 42 "), (["是 4", "fin"], "Réponse: 答案"),
                        (["42 🎉 f"], "Réponse: 答案是 "), (["nope"], text)):
        for sizes in ([1] * len(ids), [3] * len(ids), []):
            det = IncrementalDetokenizer(tok, tok.encode("Q?"), stop=stops)
            deltas, last = _stream(det, _chunks(ids, sizes))
            assert "".join(deltas) == want
            assert last.stopped == (want != text)


def test_random_greedy_like_streams_with_stops(tok):
    # Random real-token streams with a stop string picked from their own text: cut exactly at its first match.
    rng = random.Random(0)
    words = tok.encode(LONG_TEXT, add_special_tokens=False)
    for _ in range(50):
        start = rng.randrange(len(words) - 40)
        ids = words[start:start + 40]
        full = tok.decode(ids)
        a = rng.randrange(len(full) - 5)
        stop = full[a:a + rng.randint(1, 5)]
        deltas, last = _stream(IncrementalDetokenizer(tok, [], stop=[stop]), [[i] for i in ids])
        assert "".join(deltas) == full[:full.find(stop)] and last.stop_string == stop


@pytest.mark.parametrize("min_tokens, stops_at", [(0, 1), (1, 1), (2, 3), (3, 3), (4, None)])
def test_stop_strings_wait_for_min_tokens(tok, min_tokens, stops_at):
    """ "x" ends tokens 1 and 3 of " x y x z": a stop string counts from the min_tokens-th token on."""
    ids = [tok.encode(w, add_special_tokens=False) for w in (" x", " y", " x", " z")]
    assert all(len(i) == 1 for i in ids)
    det = IncrementalDetokenizer(tok, tok.encode("Say:"), stop=["x"], min_tokens=min_tokens)
    deltas, last = _stream(det, ids)
    if stops_at is None:
        assert not last.stopped and "".join(deltas) == " x y x z"
    else:
        assert last.stopped and len(deltas) == stops_at and "".join(deltas) == {1: " ", 3: " x y "}[stops_at]
