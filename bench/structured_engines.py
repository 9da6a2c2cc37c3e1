"""Grammar engines on the default model's tokenizer: compile time of a few JSON schemas, per-token mask time.

    python bench/structured_engines.py [--model DIR] [--tokens 40]

Measures llguidance and outlines-core (xgrammar is left out: its package imports torch, which the scheduler never
imports). Each engine compiles each schema once (cold: a fresh process-wide cache is not assumed), then walks a
valid JSON instance token by token, computing the full vocabulary mask before each token. Prints one line per
(engine, schema): `compile_ms=`, `mask_us_mean=`, `mask_us_max=`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from pagedserve_common.defaults import DEFAULT_MODEL  # noqa: E402

SCHEMAS = {
    "small": ({"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
               "required": ["name", "age"], "additionalProperties": False},
              {"name": "Ada", "age": 36}),
    "nested": ({"type": "object", "properties": {
        "user": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0},
                                                  "tags": {"type": "array", "items": {"type": "string"},
                                                           "maxItems": 4}},
                 "required": ["id", "tags"], "additionalProperties": False},
        "items": {"type": "array", "items": {"type": "object", "properties": {
            "sku": {"type": "string"}, "qty": {"type": "integer", "minimum": 1, "maximum": 99},
            "price": {"type": "number"}}, "required": ["sku", "qty"], "additionalProperties": False}},
        "status": {"enum": ["open", "paid", "shipped"]}},
        "required": ["user", "items", "status"], "additionalProperties": False},
        {"user": {"id": 7, "tags": ["a", "b"]}, "items": [{"sku": "X1", "qty": 2, "price": 9.5}],
         "status": "paid"}),
    "patterns": ({"type": "object", "properties": {
        "email": {"type": "string", "pattern": r"^[a-z]{1,12}@[a-z]{1,12}\.(com|org)$"},
        "date": {"type": "string", "pattern": r"^\d{4}-\d{2}-\d{2}$"},
        "code": {"type": "string", "pattern": r"^[A-Z]{3}-\d{3}$"}},
        "required": ["email", "date", "code"], "additionalProperties": False},
        {"email": "ada@example.com", "date": "2024-05-01", "code": "ABC-123"}),
}


def _tokens(tok, instance) -> list[int]:
    return tok.encode(json.dumps(instance, separators=(",", ":")), add_special_tokens=False).ids


def bench_llguidance(model_dir: str, max_tokens: int) -> None:
    import llguidance
    import llguidance.numpy as lnp
    from tokenizers import Tokenizer

    hf = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
    t = time.perf_counter()
    lltok = llguidance.LLTokenizer(hf.to_str(), n_vocab=hf.get_vocab_size())
    print(f"llguidance tokenizer_ms={1e3 * (time.perf_counter() - t):.0f}")
    options = {"whitespace_flexible": False}
    for name, (schema, instance) in SCHEMAS.items():
        t = time.perf_counter()
        grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=options)
        m = llguidance.LLMatcher(lltok, grammar, log_level=0)
        compile_ms = 1e3 * (time.perf_counter() - t)
        assert not m.is_error(), m.get_error()
        mask = lnp.allocate_token_bitmask(1, lltok.vocab_size)
        times = []
        for tok in _tokens(hf, instance)[:max_tokens]:
            t = time.perf_counter()
            lnp.fill_next_token_bitmask(m, mask)
            times.append(1e6 * (time.perf_counter() - t))
            assert m.consume_token(tok), (name, tok, m.get_error())
        print(f"llguidance {name} compile_ms={compile_ms:.1f} mask_us_mean={statistics.mean(times):.0f} "
              f"mask_us_max={max(times):.0f} tokens={len(times)}")
    # batch 64: one parallel fill over 64 matchers mid-way through the nested schema
    schema, instance = SCHEMAS["nested"]
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=options)
    toks = _tokens(hf, instance)
    matchers = []
    for i in range(64):
        m = llguidance.LLMatcher(lltok, grammar, log_level=0)
        m.consume_tokens(toks[:i % len(toks)])
        matchers.append((m, i))
    mask = lnp.allocate_token_bitmask(64, lltok.vocab_size)
    executor = llguidance.LLExecutor()
    times = []
    for _ in range(20):
        t = time.perf_counter()
        lnp.fill_next_token_bitmask_par(executor, matchers, mask)
        times.append(1e3 * (time.perf_counter() - t))
    print(f"llguidance batch64_par_fill_ms_median={statistics.median(times):.2f} max={max(times):.2f}")


def _byte_vocab(hf) -> tuple[dict, int]:
    """outlines-core's Vocabulary wants each token's bytes: undo the byte-level BPE's printable mapping."""
    chars = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    codes = chars[:]
    n = 0
    for b in range(256):
        if b not in chars:
            chars.append(b)
            codes.append(256 + n)
            n += 1
    decode = {chr(c): b for b, c in zip(chars, codes)}
    eos = hf.token_to_id("<|im_end|>")
    vocab: dict[bytes, list[int]] = {}
    for token, i in hf.get_vocab().items():
        if i == eos:
            continue
        try:
            raw = bytes(decode[ch] for ch in token)
        except KeyError:
            raw = token.encode()
        vocab.setdefault(raw, []).append(i)
    return vocab, eos


def bench_outlines(model_dir: str, max_tokens: int) -> None:
    from outlines_core import Guide, Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema
    from tokenizers import Tokenizer

    hf = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
    t = time.perf_counter()
    vocab_map, eos = _byte_vocab(hf)
    vocab = Vocabulary(eos, vocab_map)
    print(f"outlines-core vocabulary_ms={1e3 * (time.perf_counter() - t):.0f}")
    num_words = (hf.get_vocab_size() + 31) // 32
    for name, (schema, instance) in SCHEMAS.items():
        t = time.perf_counter()
        try:
            index = Index(build_regex_from_schema(json.dumps(schema)), vocab)
        except Exception as e:  # noqa: BLE001 - report what the engine cannot compile
            print(f"outlines-core {name} compile_failed={type(e).__name__}: {str(e)[:80]}")
            continue
        compile_ms = 1e3 * (time.perf_counter() - t)
        guide = Guide(index)
        mask = np.zeros(num_words, dtype=np.int32)
        times = []
        for tok in _tokens(hf, instance)[:max_tokens]:
            t = time.perf_counter()
            guide.write_mask_into(mask.ctypes.data, mask.size, 4)
            times.append(1e6 * (time.perf_counter() - t))
            guide.advance(tok)
        print(f"outlines-core {name} compile_ms={compile_ms:.1f} mask_us_mean={statistics.mean(times):.0f} "
              f"mask_us_max={max(times):.0f} tokens={len(times)}")


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=os.path.expanduser(f"~/.cache/pagedserve/models/{DEFAULT_MODEL}"))
    parser.add_argument("--tokens", type=int, default=40)
    args = parser.parse_args()
    bench_llguidance(args.model, args.tokens)
    bench_outlines(args.model, args.tokens)


if __name__ == "__main__":
    main()
