"""A tiny Llama converted from a GGUF file holding every block format (tests/support/tiny_gguf.py), and the lean
forward's logits over it: for the GPU quantised kernel's model-level checks (host shim and device)."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.support.tiny_gguf import write_tiny_gguf
from worker_svc import model_store
from worker_svc.attention import AttentionMetadata
from worker_svc.kv_pool import KVPool
from worker_svc.runner import StepContext

HIDDEN, HEADS, KV_HEADS, INTER = 32, 2, 1, 256
# every format: the projections' rows are HIDDEN (32) long but ffn_down's, INTER (256): a K-quant's super-block
FORMATS = {"token_embd": "q8_0", "attn_q": "q4_0", "attn_k": "q4_1", "attn_v": "q5_0", "attn_output": "q4_1",
           "ffn_gate": "q4_0", "ffn_up": "q8_0", "blk.0.ffn_down": "q4_k", "blk.1.ffn_down": "q6_k"}
BLOCK_SIZE = 16
PROMPT = [5, 77, 140, 3, 260, 12, 99, 31, 8]  # the lean-forward checks' prompt: 9 tokens, a partial block


def tiny_quantized_model(tmp: Path) -> Path:
    """The converted model dir (float weights + the raw blocks, worker_svc.quant.store)."""
    gguf = write_tiny_gguf(tmp / "tiny-q.gguf", hidden=HIDDEN, heads=HEADS, kv_heads=KV_HEADS, inter=INTER,
                           formats=FORMATS)
    out = tmp / "model"
    model_store.convert_gguf(gguf, out, model_store.TensorProgress(bar=False))
    return out


def prefill_then_decode_logits(lean, loaded, backend, prompt: list[int], num_decode: int,
                               device: str = "cpu") -> torch.Tensor:
    """The logits of `prompt` (one prefill, every row) then of `num_decode` more tokens (one decode each): float32
    [len(prompt) + num_decode, vocab]. The extra tokens are the prompt's, again."""
    tokens = prompt + prompt[:num_decode]
    n, total = len(prompt), len(tokens)
    pool = KVPool(loaded.kv_geometry(BLOCK_SIZE), -(-total // BLOCK_SIZE) + 1, device=device)
    table = list(range(-(-total // BLOCK_SIZE)))
    ids = lambda xs: torch.tensor(xs, device=device)  # noqa: E731
    out = []
    with torch.inference_mode():
        meta = AttentionMetadata.build([n], [n], [table], BLOCK_SIZE, device=device)
        out.append(lean.forward(ids(tokens[:n]), ids(list(range(n))), StepContext(pool.kv, meta, backend),
                                ids(list(range(n)))))
        for p in range(n, total):
            meta = AttentionMetadata.build([1], [p + 1], [table], BLOCK_SIZE, device=device)
            out.append(lean.forward(ids([tokens[p]]), ids([p]), StepContext(pool.kv, meta, backend), ids([0])))
    return torch.cat(out).float().cpu()
