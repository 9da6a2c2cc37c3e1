"""The Node.js example client (examples/node) against a real scheduler and worker: node's own test runner."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from pagedserve.v1 import generate_pb2 as pb
from pagedserve.v1 import generate_pb2_grpc

NODE_DIR = Path(__file__).resolve().parents[2] / "examples" / "node"
MAX_TOKENS = 12
# What the Node tests stream and compare, token for token, with this Python client's output.
CASES = [
    {"name": "text", "prompt": "The capital of France is"},
    {"name": "text-2", "prompt": "Once upon a time, in a land far away,"},
    {"name": "token-ids", "prompt_token_ids": [1, 504, 3458, 282, 4649, 314, 11219, 44, 30, 1535]},
    {"name": "chat", "messages": [{"role": "user", "content": "Say hello."}]},
]


def _installed() -> bool:
    """Whether examples/node/node_modules holds the lock file's dependencies (newer than the lock file)."""
    marker = NODE_DIR / "node_modules" / ".package-lock.json"  # npm writes it on every install
    return marker.exists() and marker.stat().st_mtime >= (NODE_DIR / "package-lock.json").stat().st_mtime


pytestmark = [pytest.mark.skipif(shutil.which("node") is None,
                                 reason="node is not on PATH: the Node.js example client cannot run"),
              pytest.mark.network("npm", why="npm ci installs examples/node's locked dependencies",
                                  unless=_installed)]


def _npm_ci() -> None:
    """Installs examples/node's locked dependencies unless node_modules is already newer than the lock file."""
    if _installed():
        return
    assert shutil.which("npm"), "examples/node/node_modules needs installing, but npm is not on PATH"
    r = subprocess.run(["npm", "ci", "--no-audit", "--no-fund"], cwd=NODE_DIR, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, f"npm ci failed:\n{r.stdout}\n{r.stderr}"


def _expected(service) -> dict:
    """Greedy outputs through the Python client, for the Node client to reproduce."""
    cases = []
    with service.channel() as ch:
        stub = generate_pb2_grpc.GenerationStub(ch)
        info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30)
        for case in CASES:
            sampling = {"max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
            req = pb.GenerateRequest(sampling=pb.SamplingParams(**sampling),
                                     **{k: v for k, v in case.items() if k != "name"})
            token_ids, text = [], ""
            for m in stub.Generate(req, timeout=120):
                token_ids += m.token_ids
                text += m.text
            assert len(token_ids) == MAX_TOKENS
            cases.append({**case, "sampling": sampling, "token_ids": token_ids, "text": text})
    return {"model_id": info.model_id, "vocab_size": info.vocab_size, "max_model_len": info.max_model_len,
            "cases": cases}


def test_node_client_against_the_live_service(service, tmp_path):
    _npm_ci()
    expected = tmp_path / "expected.json"
    expected.write_text(json.dumps(_expected(service), indent=1))
    env = {**os.environ, "PAGEDSERVE_SERVER": service.address, "PAGEDSERVE_METRICS": service.metrics,
           "PAGEDSERVE_EXPECTED": str(expected), "PAGEDSERVE_WORKER_PID": str(service.procs[0].pid)}
    # NOTE: no directory argument: `node --test test/` works on Node 20 only (21+ read it as a glob that matches
    # the directory itself and fail); with none, node finds test/*.test.js itself on every version.
    r = subprocess.run(["node", "--test"], cwd=NODE_DIR, env=env, capture_output=True, text=True,
                       timeout=300)
    print(r.stdout)  # node's TAP report: shown by pytest -rP, or with the failure
    assert r.returncode == 0, f"node --test failed ({r.returncode}):\n{r.stdout}\n{r.stderr}"
    # NOTE: the live tests skip without the variables above: none may have skipped here
    assert "\n# skipped 0\n" in r.stdout and "\n# fail 0\n" in r.stdout, r.stdout
