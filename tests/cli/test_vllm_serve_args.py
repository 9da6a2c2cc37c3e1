"""`pagedserve serve`: vLLM's command line as `up`'s arguments; vLLM flags refused by name; no flag abbreviated."""

from __future__ import annotations

import argparse
import os
import stat

import pytest

from pagedserve_cli.main import build_parser, main
from pagedserve_cli.up_cmd import scheduler_argv, worker_argv
from pagedserve_cli.vllm_serve_cmd import VLLM_FLAGS, to_up_args
from pagedserve_common.defaults import DEFAULT_HTTP, DEFAULT_MODEL


def serve_args(*argv: str, environ=None) -> argparse.Namespace:
    args = build_parser().parse_args(["serve", *argv])
    return to_up_args(args, environ if environ is not None else {})


def test_the_model_host_and_port_become_ups_model_and_http():
    args = serve_args("/models/m", "--host", "0.0.0.0", "--port", "8123")
    assert (args.model, args.http) == ("/models/m", "0.0.0.0:8123")
    assert serve_args("m", "--host", "::1", "--port", "9").http == "[::1]:9"


def test_without_a_model_or_host_the_defaults_are_ups():
    args = serve_args()
    assert (args.model, args.http, args.workers) == (DEFAULT_MODEL, DEFAULT_HTTP, 1)


def test_vllm_names_map_onto_the_same_tree():
    args = serve_args("m", "--no-enable-prefix-caching", "--dtype", "half", "--kv-cache-dtype", "fp8",
                      "--data-parallel-size", "3", "--served-model-name", "a", "b", "--seed", "7",
                      "--max-num-seqs", "8", "--max-num-batched-tokens", "256", "--swap-space", "2")
    assert args.no_prefix_caching is True
    assert (args.dtype, args.kv_cache_dtype, args.workers) == ("float16", "fp8_e4m3", 3)
    assert args.swap_space == 2 << 30  # vLLM's unit: GiB
    sched = scheduler_argv(args)
    assert sched[sched.index("--served-model-name"):][:3] == ["--served-model-name", "a", "b"]
    assert sched[sched.index("--seed") + 1] == "7" and "--no-prefix-caching" in sched
    assert sched[sched.index("--max-num-batched-tokens") + 1] == "256"
    work = worker_argv(args, "cpu")
    assert work[work.index("--dtype") + 1] == "float16" and work[work.index("--kv-cache-dtype") + 1] == "fp8_e4m3"
    assert serve_args("m", "--enable-prefix-caching").no_prefix_caching is False


def test_api_keys_go_to_a_file_only_this_user_reads(tmp_path):
    args = serve_args("m", "--api-key", "first-secret", "--api-key", "second-secret")
    mode = os.stat(args.api_key_file).st_mode
    assert stat.S_IMODE(mode) == 0o600 and stat.S_IMODE(os.stat(os.path.dirname(args.api_key_file)).st_mode) == 0o700
    # operator keys: vLLM's keys may ask any priority and name any tenant
    from scheduler_svc.auth import read_named_keys
    assert [key for key, _ in read_named_keys(args.api_key_file)] == ["first-secret", "second-secret"]
    with open(args.api_key_file) as f:
        assert f.read().split() == ["first-secret", "role=operator", "second-secret", "role=operator"]
    assert "-secret" not in " ".join(scheduler_argv(args))  # NOTE: never on a command line (ps shows it to all)
    from_env = serve_args("m", environ={"VLLM_API_KEY": "k3"})
    with open(from_env.api_key_file) as f:
        assert f.read().split() == ["k3", "role=operator"]


@pytest.mark.parametrize("argv, message", [
    (["--tensor-parallel-size", "2"], "--tensor-parallel-size 2: not supported: a model is not split"),
    (["--quantization", "awq"], "--quantization awq: not supported"),
    (["--gpu-memory-utilization", "0.9"], "--kv-memory"),
    (["--return-tokens-as-token-ids"], "--return-tokens-as-token-ids: not supported"),
    (["--bogus-flag", "1"], "unrecognized arguments: --bogus-flag 1"),
    (["--api-ke", "k"], "unrecognized arguments: --api-ke"),
])
def test_a_vllm_flag_not_implemented_is_refused_by_name(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["serve", "m", *argv])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_flags_that_cannot_change_an_answer_are_accepted():
    accepted = [flag for flag, rule in VLLM_FLAGS.items() if rule.accepted is None]
    argv = []
    for flag in accepted:
        argv += [flag] if not VLLM_FLAGS[flag].takes_value else [flag, "1"]
    assert serve_args("m", *argv, "--tensor-parallel-size", "1").model == "m"


def test_two_flags_saying_different_things_are_an_error():
    for argv in (["m", "--model", "n"], ["m", "--http", "127.0.0.1:1", "--port", "2"],
                 ["m", "--enable-auto-tool-choice"], ["m", "--api-key", "k", "--api-key-file", "f"]):
        with pytest.raises(ValueError):
            serve_args(*argv)


@pytest.mark.parametrize("command", ["up", "scheduler", "worker", "generate", "bench", "serve"])
def test_no_subcommand_takes_an_abbreviated_flag(command, capsys):
    # NOTE: `--api-key secret` was once read as `--api-key-file secret`; every parser has prefix matching off
    with pytest.raises(SystemExit) as exc:
        main([command, "--max-num-seq", "4"] if command != "generate" else [command, "--max-tok", "4", "hi"])
    assert exc.value.code == 2
    assert "unrecognized arguments" in capsys.readouterr().err
