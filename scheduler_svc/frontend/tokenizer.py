"""A model's tokenizer and chat template, loaded from its HF directory with `tokenizers` and jinja2 only."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _HFTokenizer

# NOTE: never import transformers here: it may import torch, and the scheduler must stay free of it
# (tests/frontend/test_text.py checks this in a subprocess).

_SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _token_str(value: Any) -> str | None:
    # Older tokenizer_config.json files store special tokens as AddedToken dicts.
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _as_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    return (value,) if isinstance(value, int) else tuple(int(v) for v in value)


class TemplateRefusal(jinja2.exceptions.TemplateError):
    """A chat template's own raise_exception("..."): its message is written for the user (e.g. roles must
    alternate), unlike a failure inside the template's code."""


def _raise_exception(message: str) -> None:
    raise TemplateRefusal(message)


class FinalMessageError(ValueError):
    """continue_final_message cannot leave this conversation's final message open: it has no content, or the chat
    template does not render that content as given (the message says which)."""


# Appended to the final message's content, then looked for in the rendered text: where the content ends there, as
# transformers finds it (the content alone may appear earlier, or be trimmed by the template).
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


def _final_content(messages: list[dict]) -> str:
    content = messages[-1].get("content") if messages else None
    if not isinstance(content, str):
        raise FinalMessageError("continue_final_message: the final message has no text content to continue")
    return content


def _cut_after_final(rendered: str, content: str) -> str:
    """`rendered` (the final message's `content` tagged with _CONTINUE_TAG) up to the end of that content."""
    tag = _CONTINUE_TAG.strip()
    if content.strip() not in rendered or tag not in rendered:
        raise FinalMessageError("continue_final_message: the chat template does not render the final message's "
                                "content as given, so the prompt cannot end inside it")
    at = rendered.rindex(tag)
    if rendered.startswith(_CONTINUE_TAG, at):
        return rendered[:at]
    return rendered[:at].rstrip()  # the template trimmed the content (and with it the tag's space): trim as well


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None,
            sort_keys: bool = False) -> str:
    # Like transformers: jinja's own tojson HTML-escapes, which would change the prompt.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (assistant-mask markers in training templates): render the body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller) -> str:
        return caller()


def _compile_template(source: str) -> jinja2.Template:
    # Same environment as transformers' apply_chat_template, so that whitespace renders identically.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def _find_chat_template(model_dir: Path, config: dict) -> str | None:
    path = model_dir / "chat_template.jinja"
    if path.is_file():
        return path.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {t["name"]: t["template"] for t in template}
        template = named.get("default")
    return template


class Tokenizer:
    """Encode, decode and render chat prompts the way transformers' AutoTokenizer does for the same directory."""

    def __init__(self, tok: _HFTokenizer, tokenizer_config: dict, eos_token_ids: Sequence[int],
                 chat_template: str | None) -> None:
        self._tok = tok
        self.special_tokens: dict[str, str | None] = {n: _token_str(tokenizer_config.get(n)) for n in _SPECIAL_NAMES}
        self.add_bos_token = bool(tokenizer_config.get("add_bos_token", False))
        self.add_eos_token = bool(tokenizer_config.get("add_eos_token", False))
        # NOTE: transformers replaces tokenizer.json's post-processor only when the config names either flag;
        # otherwise the post-processor (e.g. Llama 3's BOS template) decides which special tokens are added.
        self._explicit_bos_eos = "add_bos_token" in tokenizer_config or "add_eos_token" in tokenizer_config
        self.eos_token_ids = tuple(dict.fromkeys(eos_token_ids))  # dedupe, keep order
        self.chat_template = chat_template
        self.model_dir: Path | None = None  # where it was loaded from (a tokenizer process loads its own copy)

    def to_json(self) -> str:
        """tokenizer.json's text (the grammar engine builds its own copy of the tokenizer from it)."""
        return self._tok.to_str()

    @classmethod
    def from_model_dir(cls, path: str | Path) -> Tokenizer:
        model_dir = Path(path)
        tok = _HFTokenizer.from_file(str(model_dir / "tokenizer.json"))
        tcfg = _read_json(model_dir / "tokenizer_config.json")
        # special_tokens_map.json (older exports) fills what tokenizer_config.json leaves out.
        for name, value in _read_json(model_dir / "special_tokens_map.json").items():
            tcfg.setdefault(name, value)
        tokenizer = cls(tok, tcfg, cls._load_eos_ids(model_dir, tok, tcfg), _find_chat_template(model_dir, tcfg))
        tokenizer.model_dir = model_dir
        return tokenizer

    @staticmethod
    def _load_eos_ids(model_dir: Path, tok: _HFTokenizer, tcfg: dict) -> tuple[int, ...]:
        # generation_config.json is what generate() stops on; it may list several ids (e.g. Llama 3's eot/eom).
        if ids := _as_ids(_read_json(model_dir / "generation_config.json").get("eos_token_id")):
            return ids
        cfg = _read_json(model_dir / "config.json")
        if ids := _as_ids(cfg.get("eos_token_id", cfg.get("text_config", {}).get("eos_token_id"))):
            return ids
        eos = _token_str(tcfg.get("eos_token"))
        eos_id = tok.token_to_id(eos) if eos is not None else None
        return () if eos_id is None else (eos_id,)

    # --- vocabulary ---

    @property
    def vocab_size(self) -> int:
        """Ids this tokenizer knows, added tokens included (can be fewer than the model's embedding rows)."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token(self) -> str | None:
        return self.special_tokens["bos_token"]

    @property
    def eos_token(self) -> str | None:
        return self.special_tokens["eos_token"]

    @cached_property
    def all_special_ids(self) -> frozenset[int]:
        return frozenset(i for i, t in self._tok.get_added_tokens_decoder().items() if t.special)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def convert_ids_to_tokens(self, ids: Iterable[int], skip_special_tokens: bool = False) -> list[str | None]:
        special = self.all_special_ids if skip_special_tokens else frozenset()
        return [self._tok.id_to_token(i) for i in ids if i not in special]

    # --- encode / decode ---

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; with add_special_tokens, BOS/EOS only as the model's configs ask for them.

        NOTE: pass add_special_tokens=False for a rendered chat prompt: the template already holds its specials.
        """
        if not add_special_tokens or not self._explicit_bos_eos:
            return self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if self.add_bos_token and (bos := self._special_id("bos_token")) is not None:
            ids.insert(0, bos)
        if self.add_eos_token and (eos := self._special_id("eos_token")) is not None:
            ids.append(eos)
        return ids

    def _special_id(self, name: str) -> int | None:
        token = self.special_tokens[name]
        return None if token is None else self._tok.token_to_id(token)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        # NOTE: no clean_up_tokenization_spaces: transformers skips it for BPE, and it would break the
        # incremental detokenizer's "deltas concatenate to decode()" property.
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    # --- chat ---

    @cached_property
    def _template(self) -> jinja2.Template:
        if not self.chat_template:
            raise ValueError("this model has no chat template (chat_template.jinja or tokenizer_config.json)")
        return _compile_template(self.chat_template)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None, documents: list[dict] | None = None,
                            continue_final_message: bool = False, **template_kwargs: Any) -> str:
        """The prompt text for `messages`; extra keyword arguments (e.g. enable_thinking) reach the template.
        `continue_final_message`: the text ends right after the final message's content, as transformers' does
        (raises FinalMessageError when it cannot); it needs add_generation_prompt false."""
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message continues the final message; add_generation_prompt opens a new "
                             "assistant turn: set one of them")
        if continue_final_message:
            content = _final_content(messages)
            # NOTE: a copy: the caller's messages stay as they are
            messages = [*messages[:-1], {**messages[-1], "content": content + _CONTINUE_TAG}]
        # Keyword arguments override the special-token strings, as in transformers.
        # Unset ones stay undefined (not None), so `bos_token is defined` behaves as it does there.
        specials = {name: token for name, token in self.special_tokens.items() if token is not None}
        variables = {**specials, **template_kwargs}
        text = self._template.render(messages=messages, tools=tools, documents=documents,
                                     add_generation_prompt=add_generation_prompt, **variables)
        return _cut_after_final(text, content) if continue_final_message else text

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    continue_final_message: bool = False, add_special_tokens: bool = False,
                    **template_kwargs: Any) -> list[int]:
        """Prompt ids for `messages`: the rendered template, encoded without adding special tokens again (the
        template holds its own) unless `add_special_tokens` asks for them (vLLM's chat field)."""
        text = self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                        continue_final_message=continue_final_message, **template_kwargs)
        return self.encode(text, add_special_tokens=add_special_tokens)
