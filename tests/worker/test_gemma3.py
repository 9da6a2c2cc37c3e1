"""Gemma 3 270M, converted from its GGUF, on the paged worker: greedy tokens identical to transformers' generate (eager
attention, float32, the same dequantised weights), on short prompts and on a prompt longer than its 512-token sliding
window, prompts split into chunks and batched with decodes, on every path: the lean forward over the GGUF's quantised
blocks as stored (the default) or over float32 weights, and the transformers modules with pagedserve's attention hook
(the C++ CPU kernel and the torch backend)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer

from pagedserve_cli.bench.local_driver import LocalDriver
from tests.support.gemma3 import long_prompt
from tests.support.worker import assert_same_greedy, reference_greedy, reference_model
from worker_svc.kv_pool import KVPool
from worker_svc.models import load_model
from worker_svc.runner import ModelRunner
from worker_svc.worker import make_backend

pytestmark = pytest.mark.slow
SHORT = ["The capital of France is", "def fibonacci(n):"]
LONG_TOKENS = 560  # past the 512-token window: the sliding layers' first keys fall out of it while prefilling
LONG_NEW = 40
# a pool in which the long sequence (228 blocks when nothing is freed) evicts exactly 10 cached blocks
NUM_BLOCKS_EVICTING_2 = 218


@pytest.fixture(scope="module")
def reference(gemma3_dir):
    torch.set_num_threads(1)
    return reference_model(gemma3_dir)


# path: (lean, --weight-dtype, attention backend)
PATHS = {"lean as stored": (True, "auto", "cpu"), "lean float32": (True, "float32", "cpu"),
         "transformers+cpu": (False, "auto", "cpu"), "transformers+torch": (False, "auto", "torch")}


def paged_runner(model_dir: str, path: str, num_blocks: int = 96 * 6) -> ModelRunner:
    lean, weight_dtype, backend = PATHS[path]
    loaded = load_model(model_dir, dtype="float32", weight_dtype=weight_dtype, lean=lean)
    assert loaded.model_type == "gemma3_text"
    # the GGUF's blocks run as stored only on the lean forward (the quantised kernel; a CPU with AVX2, FMA, F16C)
    assert loaded.runs_quantized == (lean and weight_dtype == "auto"), loaded.weights_reason
    geometry = loaded.kv_geometry(16)
    # the memory of 96 blocks of all 18 layers: 96 blocks of each of the 6 KV groups (3 layers each)
    assert geometry.groups.num_groups == 6
    pool = KVPool(geometry, num_blocks)
    runner = ModelRunner(loaded, pool, make_backend(backend, "cpu", pool.geometry), lean=lean)
    assert runner.forward_path == ("lean" if lean else "transformers"), runner.lean_skip_reason
    return runner


@pytest.mark.parametrize("path", list(PATHS))
def test_gemma3_greedy_matches_transformers_across_the_sliding_window(gemma3_dir, reference, path):
    tok = AutoTokenizer.from_pretrained(gemma3_dir)
    prompts = [tok(t)["input_ids"] for t in SHORT] + [long_prompt(tok, LONG_TOKENS)]
    new = [24, 24, LONG_NEW]
    assert all(p[0] == tok.bos_token_id for p in prompts)
    refs = [reference_greedy(reference, p, n) for p, n in zip(prompts, new)]
    runner = paged_runner(gemma3_dir, path)
    # 200 tokens a step: the long prompt prefills in 3 chunks (the third past the window), beside the others' decodes
    driver = LocalDriver(runner, max_num_batched_tokens=200)
    ids = [driver.add(p, n, arrival_step=2 * i) for i, (p, n) in enumerate(zip(prompts, new))]
    out = driver.run()
    for request_id, ref in zip(ids, refs):
        assert_same_greedy(out[request_id][0], *ref)
    assert len(out[ids[2]][0]) == LONG_NEW and len(prompts[2]) + LONG_NEW > 512 + 64


def test_sliding_blocks_out_of_the_window_are_freed_and_reused_with_the_same_tokens(gemma3_dir, reference):
    """The long sequence (560 + 40 tokens: 38 blocks of 16 in each of the 6 KV groups, 228 blocks) through the
    scheduler and the worker in a pool of only 216 blocks: it fits because the scheduler frees the 5 sliding groups'
    blocks that no query can see any more, and the worker reuses them (the prompt's blocks were cached: reusing them
    evicts them); its greedy tokens are still transformers'. Chunks of 32 tokens: the admission check's bound, a
    sliding group holds at most ceil((511 + 32) / 16) + 1 = 35 blocks, so 38 + 5 x 35 = 213 fit."""
    tok = AutoTokenizer.from_pretrained(gemma3_dir)
    prompt = long_prompt(tok, LONG_TOKENS)
    ref = reference_greedy(reference, prompt, LONG_NEW)
    driver = LocalDriver(paged_runner(gemma3_dir, "lean as stored", num_blocks=216), max_num_batched_tokens=32)
    request_id = driver.add(prompt, LONG_NEW)
    kv, held = driver.scheduler.kv, []
    while driver.pending or driver.scheduler.has_unfinished_requests():
        driver.run(max_steps=driver.step_id + 1)
        seq_id = driver.requests[request_id].seq_id
        if seq_id in kv:
            held.append((kv.num_tokens(seq_id), len(kv.held_block_ids(seq_id)), len(kv.block_table(seq_id))))
    assert_same_greedy(driver.outputs[request_id][0], *ref)
    assert len(driver.outputs[request_id][0]) == LONG_NEW
    # the prompt's chunks from 480 and from 512 (whose first query still sees position 1: nothing freed yet) hold
    # every group's 32, then 34 blocks: the most it ever holds; from the next step on, sliding blocks are freed
    assert held[15:17] == [(512, 32 * 6, 32 * 6), (544, 34 * 6, 34 * 6)]
    assert max(n for _, n, _ in held) == 34 * 6
    # the last step seen holding it (the one after frees it) computes position 597: its window starts at 86, in
    # block 5, so each sliding group holds blocks 5..37 (33) beside the full group's 38; the table lists all 38 x 6
    assert held[-1] == (598, 38 + 5 * 33, 38 * 6)
    assert kv.pool.num_evictions == 12  # blocks 36 and 37 of each group: the pool's 216 fresh ids were spent


def test_a_prefix_hit_after_the_early_sliding_blocks_were_evicted_gives_the_same_tokens(gemma3_dir, reference):
    """The long prompt again, after its first run freed the sliding groups' early blocks and the pool evicted them
    (they go first): the second request still hits its 34 full blocks (544 tokens: the window of the query at 544
    starts at 33, so the sliding groups' blocks of tokens 0..31 are not needed; their table entries are stale), and
    its greedy tokens are still transformers'."""
    tok = AutoTokenizer.from_pretrained(gemma3_dir)
    prompt = long_prompt(tok, LONG_TOKENS)
    ref = reference_greedy(reference, prompt, LONG_NEW)
    driver = LocalDriver(paged_runner(gemma3_dir, "lean as stored", num_blocks=NUM_BLOCKS_EVICTING_2),
                         max_num_batched_tokens=32)
    first = driver.add(prompt, LONG_NEW)
    driver.run()
    kv = driver.scheduler.kv
    assert kv.pool.num_evictions == 10  # the 5 sliding groups' blocks 0 and 1
    second = driver.add(prompt, LONG_NEW, arrival_step=driver.step_id)
    hits = kv.prefix_hit_tokens
    driver.run()
    assert kv.prefix_hit_tokens - hits == 544
    for request_id in (first, second):
        assert_same_greedy(driver.outputs[request_id][0], *ref)


def test_the_long_prompt_needs_the_window(gemma3_dir, reference):
    """The long prompt's next-token logits with every layer attending to everything differ from the sliding ones
    by far more than float32 rounding: a forward that ignored the window could not match the tokens above."""
    tok = AutoTokenizer.from_pretrained(gemma3_dir)
    ids = torch.tensor([long_prompt(tok, LONG_TOKENS)])
    with torch.inference_mode():
        sliding = reference(ids).logits[0, -1]
        reference.config.sliding_window = 10**6
        for layer in reference.model.layers:
            if layer.self_attn.sliding_window is not None:
                layer.self_attn.sliding_window = 10**6
        try:
            full = reference(ids).logits[0, -1]
        finally:
            reference.config.sliding_window = 512
            for layer in reference.model.layers:
                if layer.self_attn.sliding_window is not None:
                    layer.self_attn.sliding_window = 512
    assert float((sliding - full).abs().max()) > 1e-2


def test_the_lean_forward_names_what_of_a_gemma3_config_it_cannot_run():
    from transformers import Gemma3TextConfig

    from worker_svc.models import lean_unsupported

    assert lean_unsupported(Gemma3TextConfig()) == ""
    assert "hidden_activation 'gelu'" in lean_unsupported(Gemma3TextConfig(hidden_activation="gelu"))
    assert lean_unsupported(Gemma3TextConfig(attn_logit_softcapping=50.0)) == "attention logit softcapping"
    linear = {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}
    assert "rope scaling" in lean_unsupported(Gemma3TextConfig(
        rope_parameters={"full_attention": linear, "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}))


def test_the_lean_forward_is_batch_invariant_across_the_window(gemma3_dir):
    """The production path's logits of a long prompt's last position are the same bits whether it is prefilled alone
    in one chunk, or in two chunks (the second past the window) packed beside another sequence's prefill and decode."""
    from worker_svc.runner import StepContext

    tok = AutoTokenizer.from_pretrained(gemma3_dir)
    tokens = torch.tensor(long_prompt(tok, LONG_TOKENS))
    other = torch.tensor(tok(SHORT[1])["input_ids"])
    runner = paged_runner(gemma3_dir, "lean as stored")
    assert runner.batch_invariant, runner.batch_invariant_reason
    n, m = len(tokens), len(other)
    ng = runner.pool.groups.num_groups  # a table holds one block per KV group per logical block
    table, table2 = list(range(36 * ng)), list(range(40 * ng, 44 * ng))

    def run(chunks):  # [(ids, positions, query_lens, seq_lens, tables, keep)] -> the last chunk's logits
        for ids, pos, q_lens, s_lens, tables, keep in chunks:
            step = StepContext.build(runner.pool, runner.backend, q_lens, s_lens, tables)
            out = runner.lean.forward(ids, pos, step, torch.tensor(keep))
        return out

    with torch.inference_mode():
        alone = run([(tokens, torch.arange(n), [n], [n], [table], [n - 1])])[0]
        cut = 300
        packed = run([
            (torch.cat([tokens[:cut], other[:-1]]), torch.cat([torch.arange(cut), torch.arange(m - 1)]),
             [cut, m - 1], [cut, m - 1], [table, table2], [cut - 1]),
            (torch.cat([other[-1:], tokens[cut:]]), torch.cat([torch.tensor([m - 1]), torch.arange(cut, n)]),
             [1, n - cut], [m, n], [table2, table], [0, n - cut]),
        ])[1]
    assert torch.equal(alone, packed)
