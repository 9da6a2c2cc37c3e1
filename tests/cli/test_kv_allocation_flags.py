"""--kv-allocation, --max-model-len and --no-prefix-caching reach each worker's SchedulerConfig; `up` forwards them."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

from pagedserve_cli.main import build_parser
from pagedserve_cli.serve_cmd import scheduler_config, scheduler_policy_argv
from pagedserve_common.defaults import DEFAULT_MODEL
from pagedserve_common.kv_geometry import KVGeometry
from pagedserve_common.registration import WorkerRegistration
from scheduler_svc.engine import Engine
from scheduler_svc.errors import EngineError, ErrorCode
from scheduler_svc.server import engine_config


def attach(tmp_path, argv: list[str], num_cpu_blocks: int = 0):
    """The SchedulerConfig a worker gets from a scheduler started with `argv`."""
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 512, "vocab_size": 100}))
    cfg = scheduler_config(build_parser().parse_args(["scheduler", *argv]), str(tmp_path))
    engine = Engine(engine_config(cfg, SimpleNamespace(eos_token_ids=(2,))))

    async def main():
        handle = engine.attach_worker(WorkerRegistration(DEFAULT_MODEL, 512, "cpu",
                                                         KVGeometry(30, 3, 64, "float32", 16), 64, num_cpu_blocks))
        engine.detach(handle)
        await handle.task
        return handle.scheduler.config
    return asyncio.run(main())


def test_without_flags_paging_with_prefix_caching_up_to_the_models_length(tmp_path):
    config = attach(tmp_path, [])
    assert (config.kv_allocation, config.enable_prefix_caching, config.max_model_len) == ("paged", True, 512)


@pytest.mark.parametrize("mode", ["paged", "static-max-model-len", "static-request"])
def test_kv_allocation_reaches_the_scheduler_config(tmp_path, mode):
    config = attach(tmp_path, ["--kv-allocation", mode, "--max-model-len", "300", "--no-prefix-caching"])
    assert (config.kv_allocation, config.enable_prefix_caching, config.max_model_len) == (mode, False, 300)


def test_an_unknown_kv_allocation_is_a_usage_error(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["scheduler", "--kv-allocation", "contiguous"])
    assert "static-max-model-len" in capsys.readouterr().err


def test_a_worker_with_swap_space_is_refused_under_a_static_kv_allocation(tmp_path):
    with pytest.raises(EngineError, match="swap space") as e:
        attach(tmp_path, ["--kv-allocation", "static-request"], num_cpu_blocks=8)
    assert e.value.code is ErrorCode.FAILED_PRECONDITION


def test_up_forwards_the_kv_flags_given_and_the_scheduler_reads_them_back():
    args = build_parser().parse_args(["up", "--kv-allocation", "static-max-model-len", "--max-model-len", "1024",
                                      "--no-prefix-caching"])
    argv = scheduler_policy_argv(args)
    assert argv == ["--max-model-len", "1024", "--no-prefix-caching", "--kv-allocation", "static-max-model-len"]
    back = build_parser().parse_args(["scheduler", *argv])
    assert (back.kv_allocation, back.max_model_len, back.no_prefix_caching) == ("static-max-model-len", 1024, True)
    assert scheduler_policy_argv(build_parser().parse_args(["up"])) == []
