"""Every long flag reads a PAGEDSERVE_* environment variable as its default; the command line still wins."""

import pytest

from pagedserve_cli.env import env_name
from pagedserve_cli.main import build_parser


def parse(monkeypatch, env: dict, argv: list[str]):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return build_parser().parse_args(argv)


def test_names_follow_the_flags():
    assert env_name("--max-num-seqs") == "PAGEDSERVE_MAX_NUM_SEQS"
    assert env_name("--kv-memory") == "PAGEDSERVE_KV_MEMORY"


def test_a_variable_sets_the_default_with_the_flags_own_type(monkeypatch):
    args = parse(monkeypatch, {"PAGEDSERVE_MAX_NUM_SEQS": "8", "PAGEDSERVE_LISTEN": "0.0.0.0:6000",
                               "PAGEDSERVE_ROUTING": "round-robin", "PAGEDSERVE_STEP_TIMEOUT": "2.5"}, ["scheduler"])
    assert (args.max_num_seqs, args.listen, args.routing, args.step_timeout) == (8, "0.0.0.0:6000", "round-robin", 2.5)
    worker = parse(monkeypatch, {"PAGEDSERVE_KV_MEMORY": "1GiB", "PAGEDSERVE_DEVICE": "cuda:auto",
                                 "PAGEDSERVE_SCHEDULER": "scheduler:50052"}, ["worker"])
    assert (worker.kv_memory, worker.device, worker.scheduler) == (1 << 30, "cuda:auto", "scheduler:50052")


def test_the_command_line_wins_over_the_environment(monkeypatch):
    args = parse(monkeypatch, {"PAGEDSERVE_MAX_NUM_SEQS": "8"}, ["scheduler", "--max-num-seqs", "4"])
    assert args.max_num_seqs == 4


def test_unset_variables_leave_the_defaults(monkeypatch):
    monkeypatch.delenv("PAGEDSERVE_MAX_NUM_SEQS", raising=False)
    assert build_parser().parse_args(["scheduler"]).max_num_seqs == 64


@pytest.mark.parametrize("value, expected", [("1", True), ("true", True), ("YES", True), ("on", True),
                                             ("0", False), ("false", False), ("", False)])
def test_switches_read_common_spellings_of_true_and_false(monkeypatch, value, expected):
    args = parse(monkeypatch, {"PAGEDSERVE_NO_PREFIX_CACHING": value}, ["scheduler"])
    assert args.no_prefix_caching is expected


@pytest.mark.parametrize("command, name, value, words", [
    ("scheduler", "PAGEDSERVE_MAX_NUM_SEQS", "many", "many"),
    ("scheduler", "PAGEDSERVE_ROUTING", "random", "random"),
    ("scheduler", "PAGEDSERVE_NO_PREFIX_CACHING", "maybe", "maybe"),
    ("worker", "PAGEDSERVE_DEVICE", "tpu", "tpu"),
    ("scheduler", "PAGEDSERVE_STEP_TIMEOUT", "-1", "seconds > 0"),
])
def test_a_bad_value_is_an_error_naming_the_variable(monkeypatch, capsys, command, name, value, words):
    with pytest.raises(SystemExit) as exit_info:
        parse(monkeypatch, {name: value}, [command])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"environment variable {name}" in err and words in err


def test_a_value_bad_for_one_subcommand_fails_only_that_one(monkeypatch, capsys):
    # --dtype: `worker` takes auto, `kv-plan` does not (it needs a concrete KV element type).
    assert parse(monkeypatch, {"PAGEDSERVE_DTYPE": "auto"}, ["worker"]).dtype == "auto"
    with pytest.raises(SystemExit):
        parse(monkeypatch, {"PAGEDSERVE_DTYPE": "auto"}, ["kv-plan", "--model", "m", "--seq-len", "8"])
    assert "environment variable PAGEDSERVE_DTYPE" in capsys.readouterr().err


def test_a_variable_satisfies_a_required_flag(monkeypatch):
    args = parse(monkeypatch, {"PAGEDSERVE_MODEL": "/models/m", "PAGEDSERVE_SEQ_LEN": "4096"}, ["kv-plan"])
    assert (args.model, args.seq_len) == ("/models/m", 4096)


def test_help_names_each_variable(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["scheduler", "--help"])
    out = " ".join(capsys.readouterr().out.split())  # help wraps lines
    assert "[env PAGEDSERVE_MAX_NUM_SEQS]" in out and "[env PAGEDSERVE_ROUTING]" in out
