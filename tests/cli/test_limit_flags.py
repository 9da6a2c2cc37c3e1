"""The input-bound flags reach the scheduler's Limits (and `up` forwards them); absent, Limits' defaults hold."""

from __future__ import annotations

from pagedserve_cli.main import build_parser
from pagedserve_cli.serve_cmd import scheduler_config, scheduler_policy_argv
from scheduler_svc.server import input_limits


def limits_of(*argv: str):
    args = build_parser().parse_args(["scheduler", *argv])
    return input_limits(scheduler_config(args, "unused"), max_model_len=512)


def test_without_flags_the_defaults_hold():
    limits = limits_of()
    assert (limits.max_message_size, limits.max_stop_strings, limits.max_prompt_chars) == (4 << 20, 16, 512 * 32)


def test_each_flag_sets_its_bound():
    limits = limits_of("--max-message-size", "1MiB", "--max-stop-strings", "2", "--max-prompt-chars", "100")
    assert (limits.max_message_size, limits.max_stop_strings, limits.max_prompt_chars) == (1 << 20, 2, 100)
    assert limits.max_stop_chars == 1024  # the fixed ones are untouched


def test_up_forwards_only_the_flags_given():
    args = build_parser().parse_args(["up", "--max-stop-strings", "2", "--max-message-size", "8MiB"])
    argv = scheduler_policy_argv(args)
    assert argv == ["--max-message-size", str(8 << 20), "--max-stop-strings", "2"]
    assert scheduler_policy_argv(build_parser().parse_args(["up"])) == []


def test_the_structured_output_bound_has_its_flag():
    assert limits_of().max_structured_output_bytes == 64 << 10
    assert limits_of("--max-structured-output-bytes", "1KiB").max_structured_output_bytes == 1024
