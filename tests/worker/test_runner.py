"""Worker pieces around the forward: model loading errors, the KV pool, seeded sampling across batches."""

from __future__ import annotations

import json
import random

import pytest
import torch

from tests.support.worker import make_runner
from pagedserve_common.sampling import SamplingParams
from worker_svc.attention.torch_backend import TorchAttentionBackend
from pagedserve_cli.bench.local_driver import LocalDriver
from pagedserve_common.kv_geometry import KVGeometry
from worker_svc.kv_pool import KVPool
from worker_svc.models import load_model
from pagedserve_common.step import NewSequence, SequenceDelta, StepPlan
from worker_svc.batch import BadPlan


def test_unsupported_architecture_names_its_model_type_and_the_supported_list(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ValueError, match=r"gpt2.*llama, mistral, qwen2, qwen3"):
        load_model(tmp_path)


def test_kv_pool_layout_bytes_and_block_copies():
    layout = KVGeometry(num_layers=30, num_kv_heads=3, head_dim=64, dtype="float32", block_size=16)
    assert layout.bytes_per_token == 2 * 30 * 3 * 64 * 4 == 46_080
    assert layout.num_blocks_for(2**20) == 2**20 // (46_080 * 16)
    small = KVPool(KVGeometry(2, 1, 4, "float32", 8), num_blocks=4)
    assert tuple(small.kv.shape) == (2, 2, 4, 8, 1, 4) and small.nbytes == 2 * 2 * 4 * 8 * 4 * 4
    small.kv[:, :, 1] = torch.arange(2 * 2 * 8 * 4, dtype=torch.float32).reshape(2, 2, 8, 1, 4)
    TorchAttentionBackend().copy_blocks(small.kv, [(1, 3)])
    assert torch.equal(small.kv[:, :, 3], small.kv[:, :, 1])
    assert not small.kv[:, :, 2].any()
    with pytest.raises(ValueError, match="no block"):
        KVPool(layout, 0)


def test_seeded_sampling_is_identical_whatever_the_batch(tiny_llama_dir):
    sampling = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1234)
    prompt = [random.Random(7).randrange(512) for _ in range(20)]

    alone = LocalDriver(make_runner(tiny_llama_dir))
    sid = alone.add(prompt, 16, sampling)
    expected = alone.run()[sid][0]

    crowded = LocalDriver(make_runner(tiny_llama_dir), max_num_batched_tokens=12)
    rng = random.Random(0)
    for i in range(5):
        other = SamplingParams(temperature=1.0, seed=rng.randrange(1000) if i % 2 else None)
        crowded.add([rng.randrange(512) for _ in range(rng.randint(3, 30))], 16, other, arrival_step=i)
    sid = crowded.add(prompt, 16, sampling, arrival_step=2)
    assert crowded.run()[sid][0] == expected
    unseeded = LocalDriver(make_runner(tiny_llama_dir))
    different = unseeded.add(prompt, 16, SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=99))
    assert unseeded.run()[different][0] != expected


def test_plans_for_unknown_or_overrun_sequences_are_rejected(tiny_llama_dir):
    runner = make_runner(tiny_llama_dir)
    with pytest.raises(BadPlan, match="running seq 7 is not on this worker"):
        runner.step(StepPlan(0, running=[SequenceDelta(7, [], 1)]))
    with pytest.raises(BadPlan, match="only 3 known"):
        runner.step(StepPlan(1, new_seqs=[NewSequence(1, [1, 2, 3], [0], 0, 4)]))
    with pytest.raises(BadPlan, match="block 64 is outside the pool"):  # never written outside the pool
        runner.step(StepPlan(2, new_seqs=[NewSequence(1, [1, 2, 3], [64], 0, 3)]))
    assert len(runner.batch) == 0


def test_chunked_prompt_samples_only_after_its_last_chunk(tiny_llama_dir):
    runner = make_runner(tiny_llama_dir, block_size=16)
    prompt = list(range(1, 21))
    out = runner.step(StepPlan(0, new_seqs=[NewSequence(5, prompt, [3, 9], 0, 12, SamplingParams(temperature=0))]))
    assert list(out.sampled) == [] and runner.batch.seqs[5].num_computed_tokens == 12
    out = runner.step(StepPlan(1, running=[SequenceDelta(5, [], 8)]))
    assert list(out.sampled) == [5] and runner.batch.seqs[5].token_ids[-1] == out.sampled[5]
    out = runner.step(StepPlan(2, running=[SequenceDelta(5, [], 1)]))
    assert list(out.sampled) == [5] and len(runner.batch.seqs[5].token_ids) == 22
    runner.step(StepPlan(3, finished_seq_ids=[5]))
    assert len(runner.batch) == 0


def test_create_runner_sizes_the_pool_from_kv_memory(tiny_llama_dir):
    from worker_svc.worker import WorkerConfig, create_runner

    runner, info = create_runner(WorkerConfig(model=tiny_llama_dir, dtype="float32", kv_memory=10 * 2**20,
                                              block_size=32))
    per_block = 2 * 2 * 2 * 16 * 4 * 32  # K+V x layers x kv_heads x head_dim x float32 x block_size
    assert info.num_blocks == 10 * 2**20 // per_block == runner.pool.num_blocks
    assert runner.pool.nbytes == info.num_blocks * per_block <= 10 * 2**20
    assert (info.block_size, info.dtype, info.max_model_len, info.device) == (32, "float32", 512, "cpu")
    assert info.model_id == tiny_llama_dir
