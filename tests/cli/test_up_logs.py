"""`up`'s stderr: every child's line tagged with the process that wrote it (JSON when stderr is not a terminal, a
`name | ` prefix on one), plain lines made JSON with a level, and each child's last error kept for up's last line."""

from __future__ import annotations

import json
import os

from pagedserve_cli.up_logs import Relay


def lines_of(capfd) -> list[str]:
    return capfd.readouterr().err.splitlines()


def test_json_lines_name_their_process_and_plain_ones_become_json(capfd):
    relay = Relay(json=True)
    relay.line("worker-1", json.dumps({"process": "worker", "event": "open files limit", "level": "info"}))
    relay.line("scheduler", "E1201 22:01:33.922613    7656 add_port.cc:83] Failed to add port to server")
    relay.line("scheduler", "W0000 00:00:00.0 1 x.cc:1] a warning")
    relay.line("worker-0", "Traceback (most recent call last):")
    relay.line("worker-0", "/lib/foo.py:3: FutureWarning: bar")
    relay.line("worker-0", "")  # nothing to say: no line
    relay.say("stopping workers")
    out = [json.loads(line) for line in lines_of(capfd)]
    assert [(e["process"], e["event"].split()[0], e["level"]) for e in out] == [
        ("worker-1", "open", "info"),  # up's name wins over the child's own (worker)
        ("scheduler", "E1201", "error"), ("scheduler", "W0000", "warning"),
        ("worker-0", "Traceback", "error"), ("worker-0", "/lib/foo.py:3:", "warning"),
        ("up", "stopping", "info")]
    assert all(e["timestamp"].endswith("Z") for e in out[1:])


def test_each_childs_last_error_is_kept(capfd):
    relay = Relay(json=True)
    relay.line("scheduler", json.dumps({"event": "scheduler listening", "level": "info"}))
    assert "scheduler" not in relay.last_error
    relay.line("scheduler", "pagedserve scheduler: error: --http 127.0.0.1:8000: address already in use")
    relay.line("worker-0", json.dumps({"event": "the scheduler refused this worker", "level": "error"}))
    # an error's details (the reason of a refusal) are part of it
    relay.line("worker-1", json.dumps({"event": "the scheduler refused this worker", "level": "error",
                                       "code": "FAILED_PRECONDITION", "details": "another up's scheduler"}))
    assert relay.last_error == {"scheduler": "--http 127.0.0.1:8000: address already in use",
                                "worker-0": "the scheduler refused this worker",
                                "worker-1": "the scheduler refused this worker: another up's scheduler"}
    assert [json.loads(line)["level"] for line in lines_of(capfd)] == ["info", "error", "error", "error"]


def test_on_a_terminal_lines_keep_their_text_behind_the_process_name(capfd):
    relay = Relay(json=False)
    relay.line("worker-0", "2026-12-01T22:05:07Z [info] worker ready")
    relay.say("draining the scheduler")
    relay.say("--http 127.0.0.1:8000: address already in use", "error")
    assert lines_of(capfd) == ["worker-0  | 2026-12-01T22:05:07Z [info] worker ready",
                               "pagedserve up: draining the scheduler",
                               "pagedserve up: error: --http 127.0.0.1:8000: address already in use"]
    assert relay.child_env()["PAGEDSERVE_LOG_FORMAT"] == "console"
    assert Relay(json=True).child_env()["PAGEDSERVE_LOG_FORMAT"] == "json"


def test_a_childs_pipe_is_relayed_to_its_end(capfd):
    relay = Relay(json=True)
    read, write = os.pipe()
    os.write(write, b'{"event": "a", "level": "info"}\nlast words \xff without a newline')
    os.close(write)
    relay.follow("worker-0", os.fdopen(read, "rb")).join(10)
    assert [json.loads(line)["event"] for line in lines_of(capfd)] == ["a", "last words \ufffd without a newline"]
