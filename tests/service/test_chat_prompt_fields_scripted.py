"""vLLM's add_special_tokens (both endpoints), documents and chat echo through the HTTP front, with a tokenizer that
adds a BOS (as Llama 3's does) and a chat template that renders documents, against a worker that speaks a scripted
answer: the prompt's ids are transformers' for the same directory, and the echoed answer is exact."""

from __future__ import annotations

import json
import shutil

import pytest

from scheduler_svc.frontend import Tokenizer
from tests.support.inproc import EOS, Front, ScriptedWorker, Speaker, wait_for, with_server
from tests.support.network import default_model_dir

BOS = 1  # <|im_start|>, which the post-processor below puts before every text encoded with special tokens
# Renders documents first (RAG templates do), trims each content and keeps its first 200 characters
TEMPLATE = ("{% for d in documents or [] %}<doc>{{ d['title'] }}: {{ d['text'] }}</doc>\n{% endfor %}"
            "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'][:200] | trim }}<|im_end|>\n"
            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
DOCUMENTS = [{"title": "Paris", "text": "The capital of France."}]
ASKED = [{"role": "user", "content": "Hi"}]
CONTINUED = [*ASKED, {"role": "assistant", "content": "Hello, "}]
CONTINUE = {"add_generation_prompt": False, "continue_final_message": True}


@pytest.fixture(scope="module")
def bos_tokenizer_dir(tmp_path_factory):
    """The default model's tokenizer, with a BOS post-processor and TEMPLATE."""
    d = tmp_path_factory.mktemp("bos-tokenizer")
    src = default_model_dir()
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json", "generation_config.json"):
        shutil.copy(src / name, d / name)
    tok = json.loads((d / "tokenizer.json").read_text())
    bos = [{"SpecialToken": {"id": "<|im_start|>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}]
    tok["post_processor"] = {"type": "TemplateProcessing", "single": bos,
                             "pair": bos + [{"Sequence": {"id": "B", "type_id": 1}}],
                             "special_tokens": {"<|im_start|>": {"id": "<|im_start|>", "ids": [BOS],
                                                                 "tokens": ["<|im_start|>"]}}}
    (d / "tokenizer.json").write_text(json.dumps(tok))
    config = json.loads((d / "tokenizer_config.json").read_text())
    config.pop("add_bos_token", None)  # NOTE: the post-processor decides, in transformers and here
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    (d / "chat_template.jinja").write_text(TEMPLATE)
    return d


@pytest.fixture(scope="module")
def hf(bos_tokenizer_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(bos_tokenizer_dir))


def test_add_special_tokens_and_documents_give_transformers_ids(bos_tokenizer_dir, hf):
    opened = {"add_generation_prompt": True}  # NOTE: vLLM's default (transformers' is false)
    chat_text = hf.apply_chat_template(ASKED, tokenize=False, **opened)
    cases = [  # (route, request fields, transformers' ids)
        ("/v1/chat/completions", {}, hf.apply_chat_template(ASKED, tokenize=True, return_dict=False, **opened)),
        ("/v1/chat/completions", {"add_special_tokens": True}, hf(chat_text)["input_ids"]),
        ("/v1/chat/completions", {"documents": DOCUMENTS},
         hf.apply_chat_template(ASKED, documents=DOCUMENTS, tokenize=True, return_dict=False, **opened)),
        ("/v1/completions", {}, hf("Hello there")["input_ids"]),
        ("/v1/completions", {"add_special_tokens": False}, hf("Hello there", add_special_tokens=False)["input_ids"]),
    ]
    assert cases[1][2][:2] == [BOS, BOS] and cases[0][2][0] == BOS  # the template's, and the tokenizer's
    assert cases[2][2][:len(cases[0][2])] != cases[0][2]  # the documents come first
    assert cases[3][2][0] == BOS != cases[4][2][0]

    @with_server(eos_token_ids=(EOS,))
    async def run(engine, channel):
        ScriptedWorker(channel, answer=True)
        await wait_for(lambda: engine.workers)
        async with Front(engine, Tokenizer.from_model_dir(bos_tokenizer_dir)) as client:
            for route, fields, ids in cases:
                given = {"messages": ASKED} if "chat" in route else {"prompt": "Hello there"}
                r = await client.post(route, json={"model": "m", "max_tokens": 1, "return_token_ids": True, **given,
                                                   **fields})
                assert r.status_code == 200, r.text
                answer = r.json()
                assert answer.get("prompt_token_ids", answer["choices"][0].get("prompt_token_ids")) == ids, fields
                if "documents" not in fields:  # NOTE: /tokenize takes no documents (nor does vLLM's)
                    assert (await client.post("/tokenize", json={**given, **fields})).json()["tokens"] == ids, fields
    run()


def test_echo_and_continue_final_message_with_a_scripted_answer(bos_tokenizer_dir):
    @with_server(eos_token_ids=(EOS,), max_num_seqs=2)
    async def run(engine, channel):
        Speaker(channel, "there!")
        await wait_for(lambda: engine.workers)
        async with Front(engine, Tokenizer.from_model_dir(bos_tokenizer_dir)) as client:
            body = {"model": "m", "max_tokens": 10, "messages": CONTINUED, "echo": True, "n": 2, **CONTINUE}
            whole = (await client.post("/v1/chat/completions", json=body)).json()
            assert [c["message"]["content"] for c in whole["choices"]] == ["Hello, there!"] * 2
            async with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
                chunks = [json.loads(line[6:]) async for line in r.aiter_lines()
                          if line.startswith("data: ") and line != "data: [DONE]"]
            for index in (0, 1):
                deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"][0]["index"] == index]
                assert deltas[1] == {"content": "Hello, "}
                assert "".join(d.get("content") or "" for d in deltas) == "Hello, there!"
            # echo without continue_final_message: the final assistant message still comes first, as in vLLM
            r = await client.post("/v1/chat/completions", json={**body, **{k: False for k in CONTINUE}, "n": 1})
            assert r.json()["choices"][0]["message"]["content"] == "Hello, there!"
            r = await client.post("/v1/chat/completions", json={**body, "messages": ASKED, "n": 1})
            assert r.json()["choices"][0]["message"]["content"] == "there!"  # a user's final message: no echo
    run()


def test_a_final_message_the_template_does_not_render_whole_is_refused_by_name(bos_tokenizer_dir):
    @with_server(eos_token_ids=(EOS,))
    async def run(engine, channel):
        ScriptedWorker(channel, answer=True)
        await wait_for(lambda: engine.workers)
        async with Front(engine, Tokenizer.from_model_dir(bos_tokenizer_dir)) as client:
            clipped = [*ASKED, {"role": "assistant", "content": "word " * 50}]  # TEMPLATE keeps 200 characters
            for route, extra in (("/v1/chat/completions", {"model": "m", "max_tokens": 1}), ("/tokenize", {})):
                r = await client.post(route, json={"messages": clipped, **CONTINUE, **extra})
                assert r.status_code == 400, r.text
                error = r.json()["error"]
                assert error["param"] == "continue_final_message" and "does not render" in error["message"], error
            r = await client.post("/v1/chat/completions", json={"model": "m", "max_tokens": 1, "messages": CONTINUED,
                                                                **CONTINUE})
            assert r.status_code == 200, r.text  # the server keeps serving
    run()
