"""The checks of tests/compose/run.sh against the published ports of a running compose project (one step each)."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import threading
import time
import urllib.request

import grpc

from pagedserve.v1 import generate_pb2 as pb
from pagedserve.v1 import generate_pb2_grpc
from pagedserve_common.defaults import DEFAULT_HTTP, DEFAULT_LISTEN, DEFAULT_METRICS

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Water boils at a temperature of"]
GREEDY_TOKENS = 24
LONG_TOKENS = 64  # streams long enough to be cut by a kill or a shutdown


def log(msg: str) -> None:
    print(f"[check] {msg}", flush=True)


def fail(msg: str) -> None:
    print(f"[check] FAILED: {msg}", file=sys.stderr, flush=True)
    sys.exit(1)


def stub(server: str):
    return generate_pb2_grpc.GenerationStub(grpc.insecure_channel(server))


def greedy(server: str) -> dict[str, list[int]]:
    out = {}
    for prompt in PROMPTS:
        req = pb.GenerateRequest(prompt=prompt, sampling=pb.SamplingParams(
            max_tokens=GREEDY_TOKENS, temperature=0, ignore_eos=True))
        out[prompt] = [t for m in stub(server).Generate(req, timeout=300) for t in m.token_ids]
    return out


def workers(server: str) -> list:
    return list(stub(server).GetModelInfo(pb.GetModelInfoRequest(), timeout=10).workers)


def metrics(url: str) -> dict[str, float]:
    """Every sample of the Prometheus text as {'name{labels}': value}."""
    text = urllib.request.urlopen(f"{url}/metrics", timeout=10).read().decode()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line and not line.startswith("#")}


def per_worker(samples: dict[str, float], name: str) -> dict[str, float]:
    """{worker name: value} of a per-worker series (its `worker` label: the name the worker registered with)."""
    out = {}
    for key, value in samples.items():
        if key.startswith(name + "{") and 'worker="' in key:
            out[key.split('worker="', 1)[1].split('"', 1)[0]] = value
    return out


class Streams:
    """`n` concurrent greedy streams of `max_tokens` tokens each, read in threads."""

    def __init__(self, server: str, n: int, tag: str, max_tokens: int = LONG_TOKENS) -> None:
        self.max_tokens = max_tokens
        self.tokens = [[] for _ in range(n)]
        self.finish = [None] * n
        self.errors: list[str] = []
        self.threads = [threading.Thread(target=self._read, args=(server, i, f"{tag} {i}: once upon a time"))
                        for i in range(n)]
        for t in self.threads:
            t.start()

    def _read(self, server: str, i: int, prompt: str) -> None:
        req = pb.GenerateRequest(prompt=prompt, sampling=pb.SamplingParams(
            max_tokens=self.max_tokens, temperature=0, ignore_eos=True))
        try:
            for m in stub(server).Generate(req, timeout=600):
                self.tokens[i] += m.token_ids
                if m.finish_reason:
                    self.finish[i] = pb.FinishReason.Name(m.finish_reason)
        except grpc.RpcError as e:
            self.errors.append(f"stream {i}: {e.code().name}: {e.details()}")

    def wait_started(self, min_tokens: int, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while min(len(t) for t in self.tokens) < min_tokens:
            if self.errors:
                fail("; ".join(self.errors))
            if time.monotonic() > deadline:
                fail(f"streams did not start: {[len(t) for t in self.tokens]} tokens")
            time.sleep(0.1)

    def join_complete(self, what: str) -> None:
        for t in self.threads:
            t.join(900)
        if self.errors:
            fail(f"{what}: " + "; ".join(self.errors))
        counts = [len(t) for t in self.tokens]
        if counts != [self.max_tokens] * len(counts) or self.finish != ["FINISH_REASON_LENGTH"] * len(counts):
            fail(f"{what}: streams ended with {counts} tokens, {self.finish}")
        log(f"{what}: all {len(counts)} streams completed with {self.max_tokens} tokens each")


def step_reference(args) -> None:
    with open(args.out, "w") as f:
        json.dump(greedy(args.server), f)
    log(f"reference from {args.server} written to {args.out}")


def step_single(args) -> None:
    reference = json.load(open(args.reference))
    got = greedy(args.server)
    for prompt, tokens in reference.items():
        if got[prompt] != tokens:
            fail(f"{prompt!r}: the container served {got[prompt]}, without containers {tokens}")
    log(f"greedy output of {len(reference)} prompts equals the output served without containers")
    # The OpenAI-compatible front through its published port: the same text as the gRPC API's.
    req = pb.GenerateRequest(prompt=PROMPTS[0], sampling=pb.SamplingParams(max_tokens=GREEDY_TOKENS, temperature=0,
                                                                           ignore_eos=True))
    text = "".join(m.text for m in stub(args.server).Generate(req, timeout=300))
    body = json.dumps({"prompt": PROMPTS[0], "max_tokens": GREEDY_TOKENS, "temperature": 0, "ignore_eos": True})
    http = urllib.request.Request(f"{args.http}/v1/completions", data=body.encode(),
                                  headers={"Content-Type": "application/json"})
    got = json.load(urllib.request.urlopen(http, timeout=300))["choices"][0]["text"]
    if got != text:
        fail(f"the HTTP front answered {got!r}, the gRPC API {text!r}")
    log(f"the OpenAI-compatible front at {args.http} answers as the gRPC API does")


def step_scale(args) -> None:
    attached = workers(args.server)
    if len(attached) != args.workers:
        fail(f"GetModelInfo lists {len(attached)} workers, expected {args.workers}: {attached}")
    log(f"GetModelInfo lists {len(attached)} workers: {', '.join(w.worker_id + '=' + w.name for w in attached)}")
    before = per_worker(metrics(args.metrics), "pagedserve_step_seconds_count")
    Streams(args.server, 2 * args.workers, "scale").join_complete("scale")
    after = per_worker(metrics(args.metrics), "pagedserve_step_seconds_count")
    steps = {w.name: after.get(w.name, 0) - before.get(w.name, 0) for w in attached}
    log(f"steps run per worker: {steps}")
    if not all(n > 0 for n in steps.values()):
        fail(f"requests did not reach every worker: {steps}")


ROGUES = {"pagedserve-rogue-no-token": [], "pagedserve-rogue-wrong-token": [
    "-e", "PAGEDSERVE_WORKER_TOKEN_FILE=/wrong/worker-token"]}


def step_rogue(args) -> None:
    """Worker containers of the same image on the project's network but without its credentials (no token, a
    wrong one) are refused: they never attach, and keep dialling, while the project's own worker serves."""
    before = workers(args.server)
    wrong = os.path.join(args.work, "wrong")
    os.makedirs(wrong, exist_ok=True)
    with open(os.path.join(wrong, "worker-token"), "w") as f:
        f.write("not-the-projects-token-0123456789abcdef\n")
    os.chmod(wrong, 0o755)
    os.chmod(os.path.join(wrong, "worker-token"), 0o644)  # NOTE: the container's user (uid 1000) reads it
    try:
        for name, extra in ROGUES.items():
            subprocess.run([args.docker, "run", "--detach", "--name", name, "--network", f"{args.project}_default",
                            "-v", f"{args.project}_cache:/cache", "-v", f"{wrong}:/wrong:ro",
                            "-e", "PAGEDSERVE_SCHEDULER=scheduler:50052", "-e", "PAGEDSERVE_KV_MEMORY=64MiB",
                            *extra, args.image, "worker"], check=True, stdout=subprocess.DEVNULL)
        for name, why in zip(ROGUES, ("no worker token", "invalid worker token")):
            deadline = time.monotonic() + 300
            while why not in (out := docker_logs(args.docker, name)):
                if time.monotonic() > deadline:
                    fail(f"{name} was not refused with {why!r} in 300 s: {out[-2000:]}")
                time.sleep(1)
            log(f"{name}: refused ({why}), and it keeps dialling")
        running = subprocess.run([args.docker, "inspect", "-f", "{{.State.Running}}", *ROGUES], capture_output=True,
                                 text=True, check=True).stdout.split()
        if running != ["true"] * len(ROGUES):
            fail(f"a refused worker exited instead of dialling again: {running}")
        after = workers(args.server)
        if [w.name for w in after] != [w.name for w in before]:
            fail(f"the attached workers changed: {[w.name for w in before]} -> {[w.name for w in after]}")
        sched = subprocess.run([*shlex.split(args.compose), "logs", "--no-color", "scheduler"], capture_output=True,
                               text=True, check=True).stdout
        refused = [line for line in sched.splitlines() if "worker refused" in line and "UNAUTHENTICATED" in line]
        if not refused or not all('"peer": "ipv4:' in line for line in refused):
            fail(f"the scheduler's refusals do not name the peer: {refused[-3:]}")
        if "not-the-projects-token" in sched:
            fail("the scheduler logged the token it was sent")
        log(f"the scheduler logged {len(refused)} refusal(s), each naming the peer; "
            f"workers attached: {[w.name for w in after]}")
    finally:
        subprocess.run([args.docker, "rm", "--force", *ROGUES], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    reference = json.load(open(args.reference))
    if greedy(args.server) != reference:
        fail("after the refusals the greedy output differs from the reference")
    log("the project's own worker still serves the reference's greedy output")


def docker_logs(docker: str, name: str) -> str:
    out = subprocess.run([docker, "logs", name], capture_output=True, text=True)
    return out.stdout + out.stderr


def step_kill(args) -> None:
    """Kills the worker container holding the most KV blocks mid-stream; every stream must still complete."""
    attached = {w.name: w for w in workers(args.server)}  # NOTE: the metrics' worker label
    migrations_before = metrics(args.metrics).get("pagedserve_migrations_total", 0)
    streams = Streams(args.server, 2 * len(attached), "kill")
    streams.wait_started(min_tokens=4)
    used = per_worker(metrics(args.metrics), "pagedserve_kv_blocks_used")
    victim_id = max((w for w in used if w in attached), key=lambda w: used[w])
    container = victim_id.rpartition(":")[0]  # the container's hostname: its short id
    log(f"killing worker {victim_id} (container {container}, {used[victim_id]:.0f} KV blocks in use)")
    subprocess.run([args.docker, "kill", container], check=True, stdout=subprocess.DEVNULL)
    streams.join_complete("after docker kill")
    migrations = metrics(args.metrics).get("pagedserve_migrations_total", 0) - migrations_before
    if migrations < 1:
        fail("no request migrated off the killed worker")
    left = [w.name for w in workers(args.server)]
    if victim_id in left:
        fail(f"the killed worker {victim_id} is still listed: {left}")
    log(f"{migrations:.0f} request(s) migrated; workers left: {left}")


def step_down(args) -> None:
    """`compose down` with streams in flight: the scheduler drains them to completion before it exits."""
    drain_during(args.server, [*shlex.split(args.compose), "down", "--volumes", "--timeout", "90"], "compose down")


def step_drain(args) -> None:
    """`--command` (a pod's deletion, a scale-down) with streams in flight: every stream completes; then
    GetModelInfo lists `--workers` workers, when given. With `--drain-seconds`, the streams are as long as this
    server decodes in that time (so that they outlast the command's checks, yet end within the drain timeout on a
    loaded machine too)."""
    tokens = paced_tokens(args.server, args.drain_seconds) if args.drain_seconds else args.tokens
    drain_during(args.server, shlex.split(args.command), args.command, tokens)
    if args.workers is not None:
        left = workers(args.server)
        if len(left) != args.workers:
            fail(f"after {args.command}: {len(left)} workers attached, expected {args.workers}: {left}")
        log(f"workers attached after it: {', '.join(w.name for w in left)}")


def paced_tokens(server: str, seconds: float, probe_tokens: int = 32) -> int:
    """How many tokens each of 2 concurrent streams gets in about `seconds` here now: measured over 2 streams of
    `probe_tokens` from start to end (prefill included, so it errs short), at most 96."""
    started = time.monotonic()
    Streams(server, 2, "pace", probe_tokens).join_complete("pace")
    rate = probe_tokens / max(time.monotonic() - started, 1e-3)
    tokens = max(24, min(96, int(rate * seconds)))
    log(f"{rate:.1f} tokens/s a stream: {tokens} tokens a stream for about {seconds:g} s")
    return tokens


def drain_during(server: str, command: list[str], what: str, max_tokens: int = LONG_TOKENS) -> None:
    streams = Streams(server, 2, "drain", max_tokens)
    streams.wait_started(min_tokens=2)
    log(f"{what} with 2 streams in flight")
    done = subprocess.run(command, capture_output=True, text=True)
    sys.stdout.write(done.stdout)
    streams.join_complete(f"during {what}")
    if done.returncode != 0:
        fail(f"{what} failed: {done.stderr}")


def main() -> None:
    p = argparse.ArgumentParser(allow_abbrev=False)
    p.add_argument("step", choices=["reference", "single", "rogue", "scale", "kill", "down", "drain"])
    p.add_argument("--server", default=DEFAULT_LISTEN)
    p.add_argument("--metrics", default=f"http://{DEFAULT_METRICS}")
    p.add_argument("--http", default=f"http://{DEFAULT_HTTP}")
    p.add_argument("--out")
    p.add_argument("--reference")
    p.add_argument("--workers", type=int)
    p.add_argument("--docker", default=os.environ.get("DOCKER", "docker"))
    p.add_argument("--compose", help="the compose command line (binary and -f files), one string")
    p.add_argument("--image", default=os.environ.get("PAGEDSERVE_IMAGE", "pagedserve:latest"))
    p.add_argument("--project", default="pagedserve", help="the compose project's name (its network and volumes)")
    p.add_argument("--work", help="a folder for files the step makes")
    p.add_argument("--command", help="drain: the command line to run with streams in flight, one string")
    p.add_argument("--tokens", type=int, default=LONG_TOKENS, help="drain: tokens per stream")
    p.add_argument("--drain-seconds", type=float, help="drain: streams as long as this many seconds of decoding")
    args = p.parse_args()
    globals()[f"step_{args.step}"](args)


if __name__ == "__main__":
    main()
