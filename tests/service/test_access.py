"""Access against real processes: TLS on the client API and the HTTP front, mutual TLS on the worker port, API keys.

Certificates are made here, at test time, with `cryptography` (pagedserve_cli.certs_cmd): the scheduler's, a
worker's, and a rogue CA's worker certificate."""

from __future__ import annotations

import os
import random
import socket
import ssl
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagedserve.v1 import generate_pb2 as pb
from pagedserve.v1 import generate_pb2_grpc
from pagedserve_cli.certs_cmd import dev_certificates, issue
from pagedserve_common.ports import free_port
from tests.support.service import MAX_BATCHED, Service, start_worker, stop_processes
from tests.support.processes import wait_for_line
from tests.support.worker import assert_same_greedy, reference_greedy, reference_model

EXE = [sys.executable, "-m", "pagedserve_cli.main"]
KEY = "test-key-" + "".join(random.Random(7).choices("abcdefghijklmnopqrstuvwxyz0123456789", k=32))
OTHER_KEY = "second-key-0123456789"
WRONG_KEY = "wrong-key-" + KEY[::-1]
PROMPT_IDS = [random.Random(5).randrange(3, 49152) for _ in range(24)]
NEW = 12


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("certs")
    for name, data in dev_certificates().items():
        (d / name).write_bytes(data)
    rogue_ca = issue("rogue CA")
    rogue = issue("pagedserve worker", rogue_ca, client=True)  # the same name, but not signed by our CA
    (d / "rogue.pem").write_bytes(rogue.cert_pem())
    (d / "rogue-key.pem").write_bytes(rogue.key_pem())
    (d / "api-keys").write_text(f"# keys for the access tests\n\n{OTHER_KEY}\n  {KEY}  \n# the end\n")
    return d


@dataclass
class Secure(Service):
    certs: Path = Path()
    logs: Path = Path()

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(root_certificates=(self.certs / "ca.pem").read_bytes())

    def channel(self) -> grpc.Channel:
        return grpc.secure_channel(self.address, self.credentials())

    def start_worker(self, name: str, *tls: str) -> tuple[subprocess.Popen, Path]:
        log = self.logs / f"{name}.log"
        return start_worker(log, self.worker_listen, self.model_dir, *tls), log

    def cert_args(self, cert: str = "worker") -> list[str]:
        return ["--tls-ca", str(self.certs / "ca.pem"), "--tls-cert", str(self.certs / f"{cert}.pem"),
                "--tls-key", str(self.certs / f"{cert}-key.pem")]


@pytest.fixture(scope="module")
def secure(tiny_served_model, certs, tmp_path_factory):
    from pagedserve_cli.up_cmd import wait_healthy

    logs = tmp_path_factory.mktemp("logs")
    listen, worker_listen, metrics, http = (f"127.0.0.1:{free_port()}" for _ in range(4))
    with open(logs / "scheduler.log", "wb") as err:
        sched = subprocess.Popen([*EXE, "scheduler", "--model", tiny_served_model, "--listen", listen,
                                  "--worker-listen", worker_listen, "--metrics", metrics, "--http", http,
                                  "--max-num-batched-tokens", str(MAX_BATCHED),
                                  "--tls-cert", str(certs / "server.pem"), "--tls-key", str(certs / "server-key.pem"),
                                  "--tls-ca", str(certs / "ca.pem"), "--api-key-file", str(certs / "api-keys")],
                                 stderr=err)
    s = Secure(tiny_served_model, listen, metrics, [sched], http, worker_listen, certs, logs)
    worker, _ = s.start_worker("worker", *s.cert_args())
    s.procs.insert(0, worker)
    try:
        wait_healthy(listen, 120, s.procs, credentials=s.credentials(), metadata=(("authorization", f"Bearer {KEY}"),))
        yield s
    finally:
        stop_processes(s.procs)


def auth(key: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {key}"),)


def generate(secure: Secure, metadata=()) -> tuple[list[int], str]:
    with secure.channel() as ch:
        msgs = list(generate_pb2_grpc.GenerationStub(ch).Generate(
            pb.GenerateRequest(prompt_token_ids=PROMPT_IDS, sampling=pb.SamplingParams(max_tokens=NEW, temperature=0)),
            metadata=metadata, timeout=120))
    return [t for m in msgs for t in m.token_ids], "".join(m.text for m in msgs)


def attached(secure: Secure) -> list[str]:
    with secure.channel() as ch:
        info = generate_pb2_grpc.GenerationStub(ch).GetModelInfo(pb.GetModelInfoRequest(), metadata=auth(KEY),
                                                                 timeout=30)
    return [w.name for w in info.workers]


def test_with_a_key_tokens_equal_a_greedy_reference_run(secure):
    tokens, _ = generate(secure, auth(KEY))
    assert_same_greedy(tokens, *reference_greedy(reference_model(secure.model_dir), PROMPT_IDS, NEW))
    assert generate(secure, auth(OTHER_KEY))[0] == tokens  # any key of the file


@pytest.mark.parametrize("metadata, message", [((), "no API key"), (auth(WRONG_KEY), "invalid API key"),
                                               ((("authorization", KEY),), "no API key")])
def test_without_a_valid_key_every_generation_method_is_unauthenticated(secure, metadata, message):
    with pytest.raises(grpc.RpcError) as e:
        generate(secure, metadata)
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED and message in e.value.details()
    assert WRONG_KEY not in e.value.details() and KEY not in e.value.details()
    with secure.channel() as ch, pytest.raises(grpc.RpcError) as e:
        generate_pb2_grpc.GenerationStub(ch).GetModelInfo(pb.GetModelInfoRequest(), metadata=metadata, timeout=30)
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_health_and_reflection_stay_open_without_a_key(secure):
    with secure.channel() as ch:
        for service in ("", "pagedserve.v1.Generation"):
            reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=30)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
        replies = reflection_pb2_grpc.ServerReflectionStub(ch).ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=30)
        names = {s.name for r in replies for s in r.list_services_response.service}
        assert "pagedserve.v1.Generation" in names


def test_a_plaintext_client_cannot_talk_to_the_tls_port(secure):
    with grpc.insecure_channel(secure.address) as ch, pytest.raises(grpc.RpcError) as e:
        health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE


def test_only_a_worker_with_a_certificate_signed_by_the_ca_attaches(secure):
    assert len(attached(secure)) == 1 and secure.metric("pagedserve_workers") == 1
    ca = ["--tls-ca", str(secure.certs / "ca.pem")]
    rogues = [secure.start_worker("no-cert", *ca), secure.start_worker("rogue", *secure.cert_args("rogue")),
              secure.start_worker("plaintext")]
    try:
        for (proc, log), tls in zip(rogues, (True, True, False)):
            line = wait_for_line(log, "waiting for the scheduler", proc)  # it tried, and was refused
            if tls:
                assert "TLS set-up failed" in line, line
            assert proc.poll() is None  # it keeps trying (with its backoff), like a worker whose scheduler is down
        assert len(attached(secure)) == 1 and secure.metric("pagedserve_workers") == 1
    finally:
        stop_processes([p for p, _ in rogues])


def test_the_attach_log_names_the_peer_and_the_certificate_subject(secure):
    line = wait_for_line(secure.logs / "scheduler.log", "worker attached", secure.procs[-1])
    assert '"peer": "ipv4:127.0.0.1:' in line and '"subject": "CN=pagedserve worker"' in line, line
    assert "token_id" not in line  # no token on this worker port


def test_the_cli_with_the_ca_and_a_key(secure):
    def cli(*args, env=None):
        clean = {k: v for k, v in os.environ.items() if not k.startswith("PAGEDSERVE_")}
        return subprocess.run([*EXE, *args], capture_output=True, text=True, timeout=120, env={**clean, **(env or {})})

    ca = ["--server", secure.address, "--tls-ca", str(secure.certs / "ca.pem")]
    prompt = ["--max-tokens", str(NEW)]
    with secure.channel() as ch:  # the same prompt as text, through the API: what the CLI must print
        _, want = generate_text(ch, "The capital of France is")
    out = cli("generate", "The capital of France is", *prompt, *ca, "--api-key", KEY)
    assert out.returncode == 0, out.stderr
    assert out.stdout == want
    out = cli("generate", "The capital of France is", *prompt, *ca, env={"PAGEDSERVE_API_KEY": KEY})
    assert out.returncode == 0 and out.stdout == want, out.stderr
    out = cli("generate", "The capital of France is", *prompt, *ca)
    assert out.returncode == 1 and "UNAUTHENTICATED" in out.stderr
    assert cli("health", *ca).returncode == 0  # no key needed
    host = ["--worker", socket.gethostname()]
    refused = cli("health", *ca, *host)
    assert refused.returncode == 1 and "UNAUTHENTICATED" in refused.stderr
    assert cli("health", *ca, *host, "--api-key", KEY).returncode == 0
    # What a worker container's health check gets from compose.tls.yaml: every flag from the environment.
    compose_env = {"PAGEDSERVE_TLS_CA": str(secure.certs / "ca.pem"), "PAGEDSERVE_API_KEY_FILE":
                   str(secure.certs / "api-keys"), "PAGEDSERVE_TLS_CERT": str(secure.certs / "worker.pem"),
                   "PAGEDSERVE_TLS_KEY": str(secure.certs / "worker-key.pem"), "PAGEDSERVE_SERVER": secure.address}
    out = cli("health", *host, env=compose_env)
    assert out.returncode == 0, out.stderr
    assert cli("health", "--server", secure.address).returncode == 1  # plaintext


def generate_text(channel, prompt: str) -> tuple[list[int], str]:
    msgs = list(generate_pb2_grpc.GenerationStub(channel).Generate(
        pb.GenerateRequest(prompt=prompt, sampling=pb.SamplingParams(max_tokens=NEW, temperature=0)),
        metadata=auth(KEY), timeout=120))
    return [t for m in msgs for t in m.token_ids], "".join(m.text for m in msgs)


def https(secure: Secure) -> httpx.Client:
    return httpx.Client(verify=ssl.create_default_context(cafile=str(secure.certs / "ca.pem")), timeout=120)


def test_http_front_needs_a_key_on_v1_but_not_on_health(secure):
    with https(secure) as http:
        assert http.get(f"https://{secure.http}/health").status_code == 200
        for headers in ({}, {"Authorization": f"Bearer {WRONG_KEY}"}, {"Authorization": KEY}):
            r = http.post(f"https://{secure.http}/v1/completions", headers=headers,
                          json={"prompt": "Hi", "max_tokens": 2})
            assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
            error = r.json()["error"]
            assert error["code"] == "invalid_api_key" and error["type"] == "invalid_request_error"
            assert error["param"] is None and KEY not in error["message"] and WRONG_KEY not in error["message"]
            assert http.get(f"https://{secure.http}/v1/models", headers=headers).status_code == 401
    with pytest.raises(httpx.TransportError):  # plain HTTP to the HTTPS port: no answer
        httpx.get(f"http://{secure.http}/health", timeout=30)


def test_the_openai_client_with_a_key_gets_the_grpc_apis_tokens(secure):
    _, want = generate(secure, auth(KEY))
    with openai.OpenAI(base_url=f"https://{secure.http}/v1", api_key=KEY, max_retries=0,
                       http_client=https(secure)) as client:
        got = client.completions.create(model=secure.model_dir, prompt=PROMPT_IDS, max_tokens=NEW, temperature=0)
        assert got.choices[0].text == want
    with openai.OpenAI(base_url=f"https://{secure.http}/v1", api_key=WRONG_KEY, max_retries=0,
                       http_client=https(secure)) as client:
        with pytest.raises(openai.AuthenticationError) as e:
            client.models.list()
        assert e.value.status_code == 401 and e.value.code == "invalid_api_key"


@pytest.mark.parametrize("keys", [(KEY, KEY), (WRONG_KEY, KEY), (KEY, WRONG_KEY)],
                         ids=["the same key twice", "a wrong key then a good one", "a good key then a wrong one"])
def test_two_authorization_headers_are_refused_on_both_apis(secure, keys):
    # NOTE: neither is picked: a proxy in front could check one and the server the other
    tokens, text = generate(secure, auth(KEY))
    two = tuple(("authorization", f"Bearer {k}") for k in keys)
    with pytest.raises(grpc.RpcError) as e:
        generate(secure, two)
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED and "more than one authorization" in e.value.details()
    with https(secure) as http:
        r = http.post(f"https://{secure.http}/v1/completions", headers=list(two),
                      json={"prompt": PROMPT_IDS, "max_tokens": NEW, "temperature": 0})
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        assert r.json()["error"]["code"] == "invalid_api_key"
        assert "more than one authorization" in r.json()["error"]["message"]
        r = http.post(f"https://{secure.http}/v1/completions", headers={"authorization": f"Bearer {KEY}"},
                      json={"prompt": PROMPT_IDS, "max_tokens": NEW, "temperature": 0})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == text
    assert generate(secure, auth(KEY))[0] == tokens


def test_the_api_docs_are_not_served(secure):
    # NOTE: FastAPI would serve them at these paths without a key; they are off (and, as every path but the
    # liveness probes and /version, need a key before even a 404 is said)
    with https(secure) as http:
        for path in ("/docs", "/redoc", "/openapi.json", "/docs/oauth2-redirect"):
            for headers, status in (({}, 401), ({"authorization": f"Bearer {KEY}"}, 404)):
                r = http.get(f"https://{secure.http}{path}", headers=headers)
                assert r.status_code == status, (path, r.status_code)
                assert set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_no_key_reaches_the_schedulers_log(secure):
    log = (secure.logs / "scheduler.log").read_text()
    listening = next(line for line in log.splitlines() if "scheduler listening" in line)
    assert '"api_keys": 2' in listening and '"mutual_tls": true' in listening
    for secret in (KEY, OTHER_KEY, WRONG_KEY):
        assert secret not in log


@pytest.mark.parametrize("args, flag", [
    (["--tls-cert", "{certs}/server.pem"], "--tls-key"),
    (["--tls-cert", "{certs}/missing.pem", "--tls-key", "{certs}/server-key.pem"], "--tls-cert"),
    (["--tls-ca", "{certs}/ca.pem"], "--tls-cert"),
    (["--api-key-file", "{certs}/empty-keys"], "--api-key-file"),
])
def test_a_bad_access_flag_fails_the_start_naming_it(tiny_served_model, certs, args, flag):
    (certs / "empty-keys").write_text("# no key yet\n\n")
    argv = [a.format(certs=certs) for a in args]
    out = subprocess.run([*EXE, "scheduler", "--model", tiny_served_model, "--listen", f"127.0.0.1:{free_port()}",
                          "--worker-listen", f"127.0.0.1:{free_port()}", "--metrics", "", *argv],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and flag in out.stderr, out.stderr


def test_up_with_tls_and_a_key_file_starts_its_workers_and_waits_for_them(tiny_served_model, certs, tmp_path):
    from tests.support.processes import stop_all, up

    # NOTE: a certificate for another name than the one `up` dials (127.0.0.1): it checks the certificate's name.
    ca = issue("up CA")
    server = issue("scheduler", ca, ["pagedserve.internal"], server=True, client=True)
    files = {"ca.pem": ca.cert_pem(), "server.pem": server.cert_pem(), "server-key.pem": server.key_pem()}
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    listen = f"127.0.0.1:{free_port()}"
    with open(tmp_path / "stderr", "w") as err:
        proc = up(tiny_served_model, listen, "--tls-cert", str(tmp_path / "server.pem"),
                  "--tls-key", str(tmp_path / "server-key.pem"), "--tls-ca", str(tmp_path / "ca.pem"),
                  "--api-key-file", str(certs / "api-keys"), stderr=err)
    try:
        line = proc.stdout.readline()
        assert line.startswith(f"pagedserve is up: {listen} (1 worker(s)") and "https://" in line, \
            (tmp_path / "stderr").read_text()[-3000:]
        credentials = grpc.ssl_channel_credentials((tmp_path / "ca.pem").read_bytes())
        with grpc.secure_channel(listen, credentials,
                                 options=[("grpc.ssl_target_name_override", "pagedserve.internal")]) as ch:
            tokens, _ = generate_text(ch, "Hello")
        assert len(tokens) > 0
    finally:
        stop_all(proc)
    assert KEY not in (tmp_path / "stderr").read_text()
