"""A tiny GGUF file made here (gguf's writer): a random float32 Llama of 2 layers with a byte-level BPE vocabulary of
the 256 bytes, a few merges and an end-of-text token, which transformers reads as it reads a real one (~40 KB); some
of its weights may be random blocks of a quantised format instead (`formats`)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

LAYERS = 2
NUM_TENSORS = 2 + 9 * LAYERS  # token_embd and output_norm, then each layer's norms and projections (tied head)
MERGES = ["h e", "l l", "he ll", "hell o"]


def _byte_symbols() -> list[str]:
    """The 256 bytes as GPT-2's byte-level BPE writes them (printable bytes as themselves, the rest shifted)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    symbols, extra = dict.fromkeys(printable), 0
    for b in range(256):
        if b not in symbols:
            symbols[b] = 256 + extra
            extra += 1
    return [chr(b if code is None else code) for b, code in symbols.items()]


def write_tiny_gguf(path: Path, hidden: int = 16, heads: int = 2, kv_heads: int = 1, inter: int = 32,
                    formats: dict[str, str] | None = None) -> Path:
    """`formats`: {tensor kind ("token_embd", "attn_q", ...: every layer's) or name without .weight ("blk.1.ffn_down"):
    worker_svc.quant format name} for weights written as random blocks of that format (rows of whole blocks)."""
    import gguf

    from tests.support.quant_blocks import random_blocks
    from worker_svc.quant.formats import FORMATS

    tokens = [*_byte_symbols(), *(m.replace(" ", "") for m in MERGES), "<|endoftext|>"]
    types = [gguf.TokenType.NORMAL] * (len(tokens) - 1) + [gguf.TokenType.CONTROL]
    vocab, head_dim = len(tokens), hidden // heads
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(64)
    w.add_block_count(LAYERS)
    w.add_feed_forward_length(inter)
    w.add_embedding_length(hidden)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(10000.0)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(MERGES)
    w.add_bos_token_id(vocab - 1)
    w.add_eos_token_id(vocab - 1)
    rng = np.random.default_rng(0)

    def weight(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.02).astype(np.float32)

    def add_weight(name: str, kind: str, tensor: np.ndarray) -> None:
        fmt_name = (formats or {}).get(name.removesuffix(".weight"), (formats or {}).get(kind))
        fmt = FORMATS[fmt_name] if fmt_name else None
        if fmt is None:
            w.add_tensor(name, tensor)
        else:
            blocks = random_blocks(rng, fmt, *tensor.shape, scale=0.002)
            w.add_tensor(name, blocks, raw_dtype=gguf.GGMLQuantizationType(fmt.ggml_type))

    ones = np.ones(hidden, np.float32)
    add_weight("token_embd.weight", "token_embd", weight(vocab, hidden))
    w.add_tensor("output_norm.weight", ones)
    for i in range(LAYERS):
        for name, tensor in (("attn_norm", ones), ("attn_q", weight(hidden, hidden)),
                             ("attn_k", weight(kv_heads * head_dim, hidden)),
                             ("attn_v", weight(kv_heads * head_dim, hidden)),
                             ("attn_output", weight(hidden, hidden)), ("ffn_norm", ones),
                             ("ffn_gate", weight(inter, hidden)), ("ffn_up", weight(inter, hidden)),
                             ("ffn_down", weight(hidden, inter))):
            add_weight(f"blk.{i}.{name}.weight", name, tensor)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
