"""Helpers for worker tests: reference generation with transformers, runners, greedy comparison."""

from __future__ import annotations

import math
from collections import Counter

import torch
from transformers import AutoModelForCausalLM

from pagedserve_common.sampling import SamplingParams
from worker_svc.kv_pool import KVPool
from worker_svc.models import load_model
from worker_svc.attention import AttentionMetadata
from worker_svc.runner import ModelRunner, StepContext
from worker_svc.worker import make_backend


def reference_model(model_dir: str):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()


# The two ways a worker runs a model: the production path (our lean forward over the C++ CPU attention kernel)
# and the transformers modules with the pagedserve hook over the torch backend (the fallback path).
PATHS = {"lean+cpu": (True, "cpu"), "transformers+torch": (False, "torch")}


def make_runner(model_dir: str, num_blocks: int = 64, block_size: int = 16, path: str = "lean+cpu") -> ModelRunner:
    lean, backend = PATHS[path]
    loaded = load_model(model_dir, dtype="float32", lean=lean)
    pool = KVPool(loaded.kv_geometry(block_size), num_blocks)
    runner = ModelRunner(loaded, pool, make_backend(backend, "cpu", pool.geometry), lean=lean)
    assert runner.forward_path == ("lean" if lean else "transformers"), runner.lean_skip_reason
    return runner


def runner_for(model_dir: str, weight_dtype: str, dtype: str = "float32", activation_dtype: str = "auto") -> ModelRunner:
    """The lean forward over the CPU attention, batch invariant, with the flags given: 64 blocks of 16 tokens."""
    loaded = load_model(model_dir, dtype=dtype, weight_dtype=weight_dtype, activation_dtype=activation_dtype)
    pool = KVPool(loaded.kv_geometry(16), 64)
    return ModelRunner(loaded, pool, make_backend("cpu", "cpu", pool.geometry), batch_invariant=True)


def prefill_then_decode_logits(runner: ModelRunner, n: int = 40, total: int = 60) -> torch.Tensor:
    """The logits of a prompt of n tokens (one prefill) and of each of the next total - n tokens (one decode each)."""
    tokens, backend, table, out = list(range(1000, 1000 + total)), runner.backend, list(range(4)), []
    with torch.inference_mode():
        meta = AttentionMetadata.build([n], [n], [table], 16)
        out.append(runner.lean.forward(torch.tensor(tokens[:n]), torch.arange(n),
                                       StepContext(runner.pool.kv, meta, backend), torch.arange(n)))
        for p in range(n, total):
            meta = AttentionMetadata.build([1], [p + 1], [table], 16)
            out.append(runner.lean.forward(torch.tensor([tokens[p]]), torch.tensor([p]),
                                           StepContext(runner.pool.kv, meta, backend), torch.tensor([0])))
    return torch.cat(out)


def swap_runner(model_dir: str) -> ModelRunner:
    """The production path (lean forward, CPU attention) in float32, with swap space: 64 blocks of 16 tokens, 32
    more on the CPU."""
    loaded = load_model(model_dir, dtype="float32")
    pool = KVPool(loaded.kv_geometry(16), 64, num_cpu_blocks=32)
    return ModelRunner(loaded, pool, make_backend("cpu", "cpu", pool.geometry))


def reference_greedy(model, prompt: list[int], max_new_tokens: int) -> tuple[list[int], torch.Tensor]:
    """transformers' own greedy generate, and the logits at every generated position."""
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=max_new_tokens,
                             output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    return out.sequences[0, len(prompt):].tolist(), torch.stack(out.logits, 1)[0]


def assert_same_greedy(got: list[int], ref: list[int], ref_logits: torch.Tensor) -> None:
    """Token-identical, except that a divergence at a near-tie (top two logits within 1e-4) ends the check."""
    for i, (g, r) in enumerate(zip(got, ref)):
        if g != r:
            top2 = torch.topk(ref_logits[i], 2).values
            assert float(top2[0] - top2[1]) < 1e-4, f"diverged at {i}: {got} != {ref}"
            return
    assert len(got) == len(ref), (got, ref)


def apply_rules(x: torch.Tensor, sp: SamplingParams, token_ids: list[int], num_prompt: int,
                eos_token_ids: tuple[int, ...] = ()) -> None:
    """The worker's logits rules (worker_svc.logits) on one row `x` (float64, in place), written out one token at a
    time: repetition, presence and frequency penalties, logit_bias, min_tokens' and bad words' masks, and the
    allow-list's; where those leave no finite logit, bad words' give way, then min_tokens'."""
    outputs = token_ids[num_prompt:]
    if sp.repetition_penalty != 1.0:
        for t in set(token_ids):
            x[t] = x[t] / sp.repetition_penalty if x[t] > 0 else x[t] * sp.repetition_penalty
    for t, c in Counter(outputs).items():
        x[t] -= sp.frequency_penalty * c + sp.presence_penalty
    for t, b in sp.logit_bias:
        x[t] += b
    biased = x.clone()
    stops = [*(() if sp.ignore_eos else eos_token_ids), *sp.stop_token_ids] if len(outputs) < sp.min_tokens else []
    words = []
    for bad in sp.bad_words_token_ids:
        prefix = list(bad[:-1])
        if len(outputs) >= len(prefix) and (not prefix or outputs[len(outputs) - len(prefix):] == prefix):
            words.append(bad[-1])
    for t in (*stops, *words):
        x[t] = -math.inf
    if sp.allowed_token_ids:
        allowed = set(sp.allowed_token_ids)
        off = [t for t in range(len(x)) if t not in allowed]
        x[off] = -math.inf
        for kept in (stops, []):  # an empty row: bad words' masks give way, then min_tokens'
            if torch.isfinite(x).any():
                break
            x.copy_(biased)
            for t in (*off, *kept):
                x[t] = -math.inf


def reference_rules(model, prompt: list[int], sp: SamplingParams, num_new: int,
                    eos_token_ids: tuple[int, ...] = ()) -> tuple[list[int], list[float]]:
    """Greedy under the worker's logits rules (worker_svc.logits), written out in float64 over transformers' own
    forward, stopping at EOS: the tokens, and at each step the gap between the two best processed logits (a near
    tie may go either way in float32)."""
    ids, gaps, past = list(prompt), [], None
    with torch.inference_mode():
        for _ in range(num_new):
            out = model(torch.tensor([ids if past is None else ids[-1:]]), past_key_values=past, use_cache=True)
            x, past = out.logits[0, -1].double(), out.past_key_values
            apply_rules(x, sp, ids, len(prompt), eos_token_ids)
            top2 = torch.topk(x, 2).values
            gaps.append(float(top2[0] - top2[1]))
            ids.append(int(x.argmax()))
            if ids[-1] in eos_token_ids:
                break
    return ids[len(prompt):], gaps


def assert_same_within_ties(got: list[int], want: list[int], gaps: list[float]) -> None:
    """Token-identical, except that a divergence at a near tie (the best two within 1e-4: `gaps`) ends the check."""
    for i, (g, w) in enumerate(zip(got, want)):
        if g != w:
            assert gaps[i] < 1e-4, f"diverged at {i}: {got} != {want}"
            return
    assert len(got) == len(want), (got, want)


def pack_bitmask(allowed, vocab: int) -> bytes:
    """A token bitmask in the wire's layout, written plainly: little-endian uint32 words, bit i of word j allows
    token 32j + i."""
    words = [0] * (-(-vocab // 32))
    for t in allowed:
        words[t // 32] |= 1 << (t % 32)
    return b"".join(w.to_bytes(4, "little") for w in words)
