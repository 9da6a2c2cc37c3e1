"""Every shell block README.md and docs/ mark runnable (`<!-- runnable -->` on the line before its fence) runs
against a real `pagedserve up` of the default model, as a reader runs it after the README's main job: it exits 0 and
prints something. The blocks name the default addresses (gRPC 127.0.0.1:50051, HTTP 127.0.0.1:8000, metrics
127.0.0.1:9464); the test's server listens on free ports instead, and each block's text has them swapped in (the
commands that take --server are also given PAGEDSERVE_SERVER, their flag's variable).

A block for a reader's terminal that does not end (a live view), that needs what the test does not have (npm, a GPU,
a container engine) or that runs for minutes stays unmarked; the README's tour is runnable whole."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

import pytest

from pagedserve_common.ports import free_port
from tests.support.processes import stop_all

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARK = "<!-- runnable -->"
BLOCK = re.compile(r"^" + re.escape(MARK) + r"[ \t]*\n```(bash|python)[ \t]*\n(.*?)^```[ \t]*$", re.M | re.S)
DEFAULTS = {"listen": "127.0.0.1:50051", "http": "127.0.0.1:8000", "metrics": "127.0.0.1:9464"}
# NOTE: curl exits 0 on an HTTP error status; a reader sees the error body, the test must fail on it.
PRELUDE = "set -eo pipefail\ncurl() { command curl --fail-with-body --silent --show-error \"$@\"; }\n"
START_TIMEOUT = 900  # the default model loaded and its kernels compiled, on a busy 2-core machine: a hang guard
BLOCK_TIMEOUT = 900  # the slowest block is the tour's `pagedserve bench` (tens of seconds on 2 cores)


@dataclass(frozen=True, slots=True)
class Block:
    page: str
    line: int
    lang: str
    text: str

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"


def runnable_blocks() -> list[Block]:
    blocks = []
    for page in PAGES:
        text = page.read_text()
        for m in BLOCK.finditer(text):
            line = text.count("\n", 0, m.start()) + 2  # the fence's line, 1-based
            blocks.append(Block(str(page.relative_to(ROOT)), line, m.group(1), m.group(2)))
    return blocks


BLOCKS = runnable_blocks()


def tour_blocks() -> list[tuple[int, bool]]:
    """(line, marked) for each fenced block of the README's "A five-minute tour" section."""
    lines = (ROOT / "README.md").read_text().splitlines()
    start = lines.index("## A five-minute tour")
    end = next(i for i in range(start + 1, len(lines)) if lines[i].startswith("## "))
    out, inside = [], False
    for i in range(start, end):
        if lines[i].startswith("```"):
            if not inside:
                out.append((i + 1, lines[i - 1].strip() == MARK))
            inside = not inside
    return out


def test_the_readme_tour_is_runnable_whole():
    tour = tour_blocks()
    assert len(tour) >= 5, tour
    assert [line for line, marked in tour if not marked] == []


def test_the_docs_mark_blocks_runnable():
    """A guard for the parsing: the pages' runnable blocks are found, on the pages known to have them."""
    pages = {b.page for b in BLOCKS}
    assert {"README.md", "docs/index.md", "docs/api.md", "docs/grpc.md"} <= pages, pages


@pytest.fixture(scope="module")
def server(default_model, tmp_path_factory):
    """`pagedserve up` as the README runs it (the default model, every default but the ports), until the module
    ends; its addresses by flag."""
    addresses = {flag: f"127.0.0.1:{free_port()}" for flag in DEFAULTS}
    log = tmp_path_factory.mktemp("runnable") / "up.log"
    argv = [sys.executable, "-m", "pagedserve_cli.main", "up", "--listen", addresses["listen"], "--http",
            addresses["http"], "--metrics", addresses["metrics"], "--worker-listen", f"127.0.0.1:{free_port()}"]
    with open(log, "w") as err:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=err, text=True, start_new_session=True)
    try:
        line = _readline(proc, START_TIMEOUT)
        assert line.startswith(f"pagedserve is up: {addresses['listen']}"), f"{line!r}\n{log.read_text()[-3000:]}"
        yield addresses
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 0, log.read_text()[-3000:]
    finally:
        stop_all(proc)


def _readline(proc: subprocess.Popen, timeout: float) -> str:
    """proc's first stdout line, or '' after `timeout` seconds (the process is then killed by the fixture)."""
    out: list[str] = []
    reader = threading.Thread(target=lambda: out.append(proc.stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout)
    return out[0] if out else ""


def localised(text: str, addresses: dict[str, str]) -> str:
    for flag, default in DEFAULTS.items():
        text = text.replace(default, addresses[flag])
    return text


@pytest.mark.parametrize("block", BLOCKS, ids=[b.id for b in BLOCKS])
def test_a_runnable_block_runs(block, server):
    env = dict(os.environ, PAGEDSERVE_SERVER=server["listen"],
               PATH=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]))
    text = localised(block.text, server)
    argv = ["bash", "-c", PRELUDE + text] if block.lang == "bash" else [sys.executable, "-c", text]
    r = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=BLOCK_TIMEOUT)
    assert r.returncode == 0, f"{block.id} exited {r.returncode}:\n{text}\n--- stdout\n{r.stdout[-3000:]}\n" \
                              f"--- stderr\n{r.stderr[-3000:]}"
    assert r.stdout.strip(), f"{block.id} printed nothing:\n{text}\n--- stderr\n{r.stderr[-3000:]}"
