"""worker_svc/lean_stack.py: the lean forward's layer loop in one C++ call gives the Python loop's logits bit for bit
(the same kernels, arguments and order) on each kernel it covers (the quantised ones with float and int8
activations, the float32 and bfloat16 panels), in prefills, decodes and mixed multi-sequence steps; the steps it
does not cover go to the Python loop; a bad slot is refused naming the layer."""

from __future__ import annotations

import pytest
import torch

from tests.support.worker import runner_for
from worker_svc.attention import AttentionMetadata
from worker_svc.cpu_ops import shared_ops
from worker_svc.kv_pool import KVPool
from worker_svc.linear import F32_PANEL_ROWS
from worker_svc.models import load_model
from worker_svc.quant.kernel import shared_kernel
from worker_svc.runner import ModelRunner, StepContext
from worker_svc.worker import make_backend

pytestmark = pytest.mark.slow
NO_QUANT = shared_kernel() is None or shared_kernel(True) is None
NO_PANELS = shared_ops() is None or not shared_ops().panel_width()

# (weight dtype, dtype, activation dtype): the kernel each config's matmuls run on
CONFIGS = [
    pytest.param("as-stored", "float32", "auto", id="q4_1-float-activations",
                 marks=pytest.mark.skipif(NO_QUANT, reason="no quantised kernel on this CPU")),
    pytest.param("as-stored", "bfloat16", "int8", id="q4_1-int8-activations",
                 marks=pytest.mark.skipif(NO_QUANT, reason="no quantised kernel on this CPU")),
    pytest.param("float32", "float32", "auto", id="float32-panels",
                 marks=pytest.mark.skipif(NO_PANELS, reason="no panel kernel on this CPU")),
    pytest.param("bfloat16", "bfloat16", "auto", id="bfloat16-panels-or-amx",
                 marks=pytest.mark.skipif(NO_PANELS, reason="no panel kernel on this CPU")),
]

# Steps over a 64-block pool: (query_lens, seq_lens, block tables); tokens and positions follow from them. A
# prefill alone, then a decode beside a prefill chunk, then a decode beside the next chunk and a third sequence's
# whole prompt.
STEPS = [
    ([20], [20], [[0, 1]]),
    ([1, 12], [21, 12], [[0, 1], [2]]),
    ([1, 5, 9], [22, 17, 9], [[0, 1], [2, 3], [4]]),
]


def _step_logits(runner: ModelRunner, query_lens, seq_lens, tables) -> torch.Tensor:
    positions = torch.cat([torch.arange(s - q, s) for q, s in zip(query_lens, seq_lens)])
    ids = 1000 + 7 * positions + torch.repeat_interleave(torch.arange(len(query_lens)), torch.tensor(query_lens))
    keep = torch.cumsum(torch.tensor(query_lens), 0) - 1  # each sequence's last row
    meta = AttentionMetadata.build(query_lens, seq_lens, tables, 16)
    return runner.lean.forward(ids, positions, StepContext(runner.pool.kv, meta, runner.backend), keep)


def _run(runner: ModelRunner) -> list[torch.Tensor]:
    runner.pool.kv.zero_()
    with torch.inference_mode():
        return [_step_logits(runner, *step) for step in STEPS]


@pytest.mark.parametrize("weight_dtype,dtype,activation_dtype", CONFIGS)
def test_the_stack_gives_the_python_loops_logits_bit_for_bit(smollm2_dir, weight_dtype, dtype, activation_dtype):
    runner = runner_for(smollm2_dir, weight_dtype, dtype, activation_dtype)
    stack = runner.lean.stack
    assert stack is not None and stack.max_rows > 10**9  # batch invariant: every matmul's kernel at every row count
    ran = []
    real_run = stack.run
    stack.run = lambda *args: ran.append(real_run(*args)) or ran[-1]
    with_stack = _run(runner)
    assert len(ran) == len(STEPS) and all(down is not None for down in ran)
    runner.lean.stack = None
    python_loop = _run(runner)
    for got, want in zip(with_stack, python_loop):
        assert got.dtype == getattr(torch, dtype) and torch.equal(got, want)


@pytest.mark.skipif(NO_PANELS, reason="no panel kernel on this CPU")
def test_steps_the_stack_does_not_cover_go_to_the_python_loop(smollm2_dir):
    # not batch invariant: float32 matmuls of more than F32_PANEL_ROWS rows leave the panels for oneDNN
    loaded = load_model(smollm2_dir, dtype="float32", weight_dtype="float32")
    pool = KVPool(loaded.kv_geometry(16), 64)
    runner = ModelRunner(loaded, pool, make_backend("cpu", "cpu", pool.geometry), batch_invariant=False)
    stack = runner.lean.stack
    assert stack.max_rows == F32_PANEL_ROWS

    def covered(rows: int, dtype=torch.float32, **kv) -> bool:
        meta = AttentionMetadata.build([rows], [rows], [list(range(-(-rows // 16)))], 16)
        x, rope = torch.zeros(rows, 576, dtype=dtype), torch.zeros(rows, 64, dtype=dtype)
        with torch.inference_mode():
            return stack.run(x, x.clone(), rope, rope, StepContext(pool.kv, meta, runner.backend, **kv)) is not None

    assert covered(4) and covered(F32_PANEL_ROWS)
    assert not covered(F32_PANEL_ROWS + 1)  # a matmul past its panel rows
    assert not covered(4, kv_scales=torch.ones(30, 2, 64, 16, 3))  # an 8-bit cache: its writes quantise
    assert not covered(4, torch.bfloat16)  # activations of another dtype than the pool's


@pytest.mark.skipif(NO_QUANT, reason="no quantised kernel on this CPU")
def test_a_slot_outside_the_pool_is_refused_naming_the_layer(smollm2_dir):
    runner = runner_for(smollm2_dir, "as-stored")
    with pytest.raises(IndexError, match="layer 0: the KV write"):
        _step_logits(runner, [3], [3], [[64]])  # block 64 of a 64-block pool
    runner.lean.stack = None
    with pytest.raises(IndexError, match="slot"):  # the Python loop's refusal, for comparison
        _step_logits(runner, [3], [3], [[64]])
