"""Who may attach as a worker (scheduler_svc.worker_auth): the start-up check of the worker port, worker tokens."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys

import pytest

from pagedserve_cli.main import build_parser
from pagedserve_cli.up_cmd import worker_argv
from scheduler_svc.auth import ApiKeyFileError
from scheduler_svc.worker_auth import (INVALID_TOKEN, MISSING_TOKEN, TWO_TOKENS, InsecureWorkersError, WorkerGate,
                                       WorkerTokens, loopback_only, port_auth, token_id)

TOKEN, OLD_TOKEN = "tok-" + "a1" * 20, "old-" + "b2" * 20
REACHABLE = ["0.0.0.0:50052", ":50052", "[::]:50052", "10.1.2.3:50052", "scheduler:50052", "[fe80::1]:7"]
LOOPBACK = ["127.0.0.1:50052", "127.8.9.10:1", "[::1]:50052", "localhost:50052", "LOCALHOST:9"]


@pytest.mark.parametrize("address", LOOPBACK)
def test_loopback_addresses_are_loopback_only(address):
    assert loopback_only(address)
    assert port_auth(address, mutual_tls=False, token=False, insecure=False) == "none (loopback only)"


@pytest.mark.parametrize("address", REACHABLE)
def test_a_reachable_worker_port_without_authentication_is_refused_saying_why_and_what_to_do(address):
    assert not loopback_only(address)
    with pytest.raises(InsecureWorkersError) as e:
        port_auth(address, mutual_tls=False, token=False, insecure=False)
    message = str(e.value)
    for words in (f"--worker-listen {address}", "not loopback-only", "--worker-token-file", "--tls-ca",
                  "--insecure-workers", "pagedserve worker-token"):
        assert words in message, message
    assert isinstance(e.value, ValueError)  # the CLI reports it as `error: ...`, exit 2


@pytest.mark.parametrize("address", REACHABLE)
def test_a_reachable_worker_port_starts_with_mutual_tls_a_token_or_insecure_workers(address):
    assert port_auth(address, mutual_tls=True, token=False, insecure=False) == "mutual TLS"
    assert port_auth(address, mutual_tls=False, token=True, insecure=False) == "token"
    assert port_auth(address, mutual_tls=True, token=True, insecure=False) == "mutual TLS and token"
    assert port_auth(address, mutual_tls=False, token=False, insecure=True) == "none (--insecure-workers)"


def write(tmp_path, text: str) -> str:
    path = tmp_path / "worker-token"
    path.write_text(text)
    return str(path)


def test_any_token_of_the_file_is_accepted_and_named_by_its_fingerprint(tmp_path):
    tokens = WorkerTokens.load(write(tmp_path, f"# rotating\n{OLD_TOKEN}\n\n  {TOKEN}  \n"))
    assert len(tokens) == 2
    fingerprint = hashlib.sha256(TOKEN.encode()).hexdigest()[:12]
    assert token_id(TOKEN) == fingerprint
    assert tokens.check([f"Bearer {TOKEN}"]) == (fingerprint, None)
    assert tokens.check([f"bearer {OLD_TOKEN}".encode()]) == (token_id(OLD_TOKEN), None)
    assert TOKEN not in repr(tokens) and fingerprint not in repr(tokens)


@pytest.mark.parametrize("authorizations, why", [
    ([], MISSING_TOKEN), (["Bearer "], MISSING_TOKEN), ([TOKEN], MISSING_TOKEN), (["Basic " + TOKEN], MISSING_TOKEN),
    (["Bearer " + TOKEN[:-1]], INVALID_TOKEN), (["Bearer " + TOKEN + "x"], INVALID_TOKEN),
    (["Bearer " + TOKEN, "Bearer " + TOKEN], TWO_TOKENS)])
def test_a_missing_wrong_or_doubled_token_is_refused_without_echoing_it(tmp_path, authorizations, why):
    tokens = WorkerTokens.load(write(tmp_path, TOKEN + "\n"))
    assert tokens.check(authorizations) == (None, why)
    assert TOKEN[:8] not in why


def test_a_bad_token_file_names_its_flag(tmp_path):
    with pytest.raises(ApiKeyFileError, match="--worker-token-file .*: no token in it"):
        WorkerTokens.load(write(tmp_path, "# none yet\n"))
    with pytest.raises(ApiKeyFileError, match="--worker-token-file .*: line 2: a token is printable"):
        WorkerTokens.load(write(tmp_path, "ok\nwith space\n"))
    with pytest.raises(ApiKeyFileError, match="--worker-token-file .*missing.*cannot read it"):
        WorkerTokens.load(str(tmp_path / "missing"))


def test_the_gate_loads_the_tokens_and_says_when_it_lets_anyone_in(tmp_path):
    path = write(tmp_path, TOKEN + "\n")
    gate = WorkerGate.load("0.0.0.0:1", path, mutual_tls=False, insecure=False)
    assert (gate.auth, len(gate.tokens), gate.insecure) == ("token", 1, False)
    assert WorkerGate.load("0.0.0.0:1", None, mutual_tls=False, insecure=True).insecure
    assert not WorkerGate.load("127.0.0.1:1", None, mutual_tls=False, insecure=True).insecure  # nothing to accept
    with pytest.raises(InsecureWorkersError):
        WorkerGate.load("0.0.0.0:1", None, mutual_tls=False, insecure=False)


def test_up_gives_its_workers_the_schedulers_token_file(tmp_path):
    args = build_parser().parse_args(["up", "--worker-token-file", "/run/t"])
    assert worker_argv(args, "cpu")[-2:] == ["--worker-token-file", "/run/t"]
    assert "--worker-token-file" not in worker_argv(build_parser().parse_args(["up"]), "cpu")


def cli(*args: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pagedserve_cli.main", *args], capture_output=True, text=True,
                          timeout=120, cwd=cwd)


def test_up_refuses_a_reachable_worker_port_before_starting_anything(tmp_path):
    out = cli("up", "--worker-listen", "0.0.0.0:50052", "--model", str(tmp_path / "no-model-needed"))
    (line,) = out.stderr.splitlines()  # JSON: stderr is not a terminal
    said = json.loads(line)
    assert out.returncode == 2 and (said["process"], said["level"]) == ("up", "error"), out.stderr
    assert said["event"].startswith("--worker-listen 0.0.0.0:50052 is not loopback-only"), out.stderr


def test_worker_token_writes_a_private_file_once(tmp_path):
    path = tmp_path / "sub" / "worker-token"
    out = cli("worker-token", str(path))
    assert out.returncode == 0 and path.stat().st_mode & 0o777 == 0o600
    (token,) = [line for line in path.read_text().splitlines() if not line.startswith("#")]
    assert len(token) >= 40 and token not in out.stdout
    assert WorkerTokens.load(str(path)).check([f"Bearer {token}"])[1] is None
    again = cli("worker-token", str(path))
    assert again.returncode == 2 and "exists already" in again.stderr
    assert cli("worker-token", str(path), "--keep").returncode == 0 and token in path.read_text()
    assert cli("worker-token", str(path), "--force").returncode == 0 and token not in path.read_text()
