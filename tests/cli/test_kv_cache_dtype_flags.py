"""--kv-cache-dtype and PAGEDSERVE_KV_CACHE_DTYPE: an unknown cache dtype is a usage error naming the flag (or the
variable); under `up`, either route reaches every worker's command line, and the worker's config."""

from __future__ import annotations

import pytest

from pagedserve_cli.main import build_parser
from pagedserve_cli.up_cmd import worker_argv
from pagedserve_common.config import WorkerOptions
from pagedserve_common.options import build, values
from worker_svc.worker import WorkerConfig


@pytest.mark.parametrize("command", ["worker", "up"])
def test_an_unknown_cache_dtype_is_a_usage_error_naming_the_flag(capsys, command):
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args([command, "--kv-cache-dtype", "int4"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "argument --kv-cache-dtype: invalid choice: 'int4'" in err and "'int8', 'fp8_e4m3', 'fp8_e5m2'" in err, err


@pytest.mark.parametrize("command", ["worker", "up"])
def test_an_unknown_cache_dtype_in_the_environment_is_an_error_naming_the_variable(monkeypatch, capsys, command):
    monkeypatch.setenv("PAGEDSERVE_KV_CACHE_DTYPE", "int4")
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args([command])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "environment variable PAGEDSERVE_KV_CACHE_DTYPE" in err and "'int4'" in err and "int8" in err, err


def worker_config(up_argv: list[str]) -> WorkerConfig:
    """The config of a worker `up` starts with `up_argv`, through the worker's own parser."""
    args = build_parser().parse_args(["worker", *worker_argv(build_parser().parse_args(["up", *up_argv]), "cpu")])
    return WorkerConfig(**values(build(WorkerOptions, args).runner))  # NOTE: as serve_cmd builds it


def test_the_flag_and_the_variable_reach_each_worker_under_up(monkeypatch):
    monkeypatch.delenv("PAGEDSERVE_KV_CACHE_DTYPE", raising=False)
    assert "--kv-cache-dtype" not in worker_argv(build_parser().parse_args(["up"]), "cpu")  # auto: not forwarded
    assert worker_config([]).kv_cache_dtype == "auto"
    assert worker_config(["--kv-cache-dtype", "int8"]).kv_cache_dtype == "int8"
    monkeypatch.setenv("PAGEDSERVE_KV_CACHE_DTYPE", "fp8_e4m3")
    argv = worker_argv(build_parser().parse_args(["up"]), "cpu")
    assert argv[argv.index("--kv-cache-dtype") + 1] == "fp8_e4m3"  # on the command line, not only inherited
    monkeypatch.delenv("PAGEDSERVE_KV_CACHE_DTYPE")
    assert build_parser().parse_args(["worker", *argv]).kv_cache_dtype == "fp8_e4m3"
    monkeypatch.setenv("PAGEDSERVE_KV_CACHE_DTYPE", "fp8_e4m3")
    assert worker_config(["--kv-cache-dtype", "int8"]).kv_cache_dtype == "int8"  # the command line wins
