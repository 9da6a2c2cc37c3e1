"""SchedulerConfig.for_worker: one attached worker's scheduler configuration, from the engine's and the worker's."""

from pagedserve_common.config import CPU_BATCHED_TOKENS, GPU_BATCHED_TOKENS
from pagedserve_common.kv_geometry import KVGeometry
from pagedserve_common.registration import WorkerRegistration
from scheduler_svc.core.config import SchedulerConfig
from scheduler_svc.engine import EngineConfig


def registration(device: str = "cpu", num_cpu_blocks: int = 0) -> WorkerRegistration:
    geometry = KVGeometry(num_layers=2, num_kv_heads=2, head_dim=64, block_size=32, dtype="float32")
    return WorkerRegistration("m", 4096, device, geometry, num_blocks=900, num_cpu_blocks=num_cpu_blocks)


def test_the_engines_flags_and_the_workers_pool_make_the_config():
    engine = EngineConfig(model_id="m", max_model_len=1024, vocab_size=100, eos_token_ids=(2, 7), max_num_seqs=8,
                          max_num_batched_tokens=300, no_prefix_caching=True, kv_allocation="static-request",
                          speculative="ngram", num_speculative_tokens=3, scheduling_policy="priority",
                          priority_max_wait=5.0)
    config = SchedulerConfig.for_worker(engine, registration(num_cpu_blocks=12))
    assert config == SchedulerConfig(num_blocks=900, max_model_len=1024, max_num_seqs=8, max_num_batched_tokens=300,
                                     block_size=32, enable_prefix_caching=False, eos_token_ids=(2, 7),
                                     num_cpu_blocks=12, kv_allocation="static-request", speculative="ngram",
                                     num_speculative_tokens=3, scheduling_policy="priority", priority_max_wait=5.0)


def test_without_a_token_budget_the_workers_device_picks_it():
    engine = EngineConfig(model_id="m", max_model_len=1024, vocab_size=100)
    assert SchedulerConfig.for_worker(engine, registration("cpu")).max_num_batched_tokens == CPU_BATCHED_TOKENS
    assert SchedulerConfig.for_worker(engine, registration("cuda:1")).max_num_batched_tokens == GPU_BATCHED_TOKENS
    # the engine's defaults are the flags' defaults
    config = SchedulerConfig.for_worker(engine, registration())
    assert (config.enable_prefix_caching, config.scheduling_policy, config.speculative) == (True, "fcfs", "none")
