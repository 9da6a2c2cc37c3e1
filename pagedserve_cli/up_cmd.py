"""`pagedserve up`: one scheduler and N workers as child processes, on the default addresses.

The children run in sessions of their own (Ctrl-C in the terminal reaches only `up`) and get SIGTERM if `up` dies.
`up` restarts a child that dies, with a back-off when it keeps dying right after starting, and stops them in order:
the scheduler first (it drains its streams), then the workers. It knows its own children: it refuses to start on a
port in use (another `up`, most likely), and marks its children with a nonce (make_children) that its health wait
checks and that keeps its workers off another up's scheduler."""

from __future__ import annotations

import argparse
import ctypes
import errno
import os
import secrets
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from pagedserve_cli import access_args, worker_token_cmd
from pagedserve_cli.flags import DefaultsFormatter, add_flags, forward_argv
from pagedserve_cli.private_files import private_file
from pagedserve_cli.serve_cmd import model_dir
from pagedserve_cli.up_logs import Relay
from pagedserve_common.config import (UP_NONCE_METADATA, UP_NONCE_VARIABLE, EngineOptions, RunnerOptions,
                                      SchedulerOptions, UpOptions, WorkerOptions)
from pagedserve_common.model_spec import ModelFetchError, snapshot_commit
from pagedserve_common.startup import BIND_ERRORS, USAGE, StartupError, check_bindable

CRASH_LOOP_SECONDS = 10.0  # a child that dies sooner than this after starting is restarted after a back-off
FIRST_BACKOFF, MAX_BACKOFF = 1.0, 30.0  # that back-off doubles from 1 s up to 30 s
STOP_MARGIN = 30.0  # seconds `up` waits for the scheduler beyond its drain timeout, and for each worker
PR_SET_PDEATHSIG = 1


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("up", help="start a scheduler and N workers; Ctrl-C stops them all",
                       formatter_class=DefaultsFormatter)
    add_flags(p, UpOptions)
    # NOTE: the scheduler's and the workers' flags that Option.up marks: forwarded (scheduler_argv, worker_argv);
    # the scheduler's access flags too, and the workers get --tls-ca/--tls-cert/--tls-key from them (access_args).
    add_flags(p, SchedulerOptions, child="scheduler")
    add_flags(p, WorkerOptions, child="worker")
    p.set_defaults(func=run)


def scheduler_argv(args: argparse.Namespace) -> list[str]:
    """The scheduler's command-line arguments under `up`."""
    return [*forward_argv(args, SchedulerOptions), "--http", args.http]


def worker_argv(args: argparse.Namespace, device: str) -> list[str]:
    """A worker's command-line arguments under `up` (its TLS flags come from access_args.up_tls); the scheduler's
    --worker-token-file is the workers' too."""
    token = ["--worker-token-file", args.worker_token_file] if args.worker_token_file else []
    return ["--scheduler", args.worker_listen, "--device", device, *forward_argv(args, RunnerOptions), *token]


def listening_addresses(args: argparse.Namespace) -> list[tuple[str, str]]:
    """(flag, HOST:PORT) of each port `up`'s scheduler will listen on ('' is off: none)."""
    named = (("--listen", args.listen), ("--worker-listen", args.worker_listen), ("--http", args.http),
             ("--metrics", args.metrics))
    return [(flag, address) for flag, address in named if address]


def check_ports_free(args: argparse.Namespace) -> None:
    """Raises StartupError naming the flag and the address when a port the scheduler will listen on is taken, before
    anything starts. NOTE: most likely by another `up`: without this check, this one's scheduler would crash-loop on
    the port while its health wait and its workers found the other's. The same bind as the scheduler's
    (check_bindable: SO_REUSEADDR, as gRPC, the HTTP front and the metrics server bind)."""
    in_use = f": {BIND_ERRORS[errno.EADDRINUSE]} ("  # bind_failure's words for EADDRINUSE
    for flag, address in listening_addresses(args):
        try:
            check_bindable(flag, address)
        except StartupError as e:
            if in_use not in str(e):
                raise  # a host that is not this one, a port that needs privileges: said as the scheduler says it
            raise StartupError(f"{flag} {address} is in use (another pagedserve up? stop it, or pass another "
                               f"{flag} HOST:PORT)") from None


class NotOurScheduler(RuntimeError):
    """The server answering `up`'s health wait is not the scheduler this `up` started (another nonce, or none)."""

    def __init__(self, address: str) -> None:
        super().__init__(f"{address} is answered by a server this `up` did not start (another pagedserve up?)")


class ChildExited(RuntimeError):
    """A service `up` started (one of `wait_healthy`'s processes) exited before all were up."""

    def __init__(self, proc: subprocess.Popen) -> None:
        super().__init__(f"a service exited during start-up ({describe_exit(proc.returncode)}; see its log above)")
        self.proc = proc


def wait_healthy(address: str, timeout: float, procs: list[subprocess.Popen], stopping=lambda: False,
                 num_workers: int = 1, credentials=None, server_name: str | None = None, metadata=(),
                 up_nonce: str | None = None) -> bool:
    """True once `address` is SERVING with `num_workers` attached; False if `stopping()` turns true first.
    `credentials`, `server_name` and `metadata` (an API key) as for a TLS client (access_args). With `up_nonce`
    (up's, which its scheduler answers health checks with), a server answering with another (or none) raises
    NotOurScheduler: another process owns the port, and its health is not ours to report."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from pagedserve.v1 import generate_pb2, generate_pb2_grpc

    deadline = time.monotonic() + timeout
    with access_args.open_channel(address, credentials, server_name) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        generation = generate_pb2_grpc.GenerationStub(channel)
        while time.monotonic() < deadline:
            if stopping():
                return False
            if exited := [p for p in procs if p.poll() is not None]:
                raise ChildExited(exited[0])
            try:
                answer, call = health.Check.with_call(health_pb2.HealthCheckRequest(service=""), timeout=1)
                if up_nonce is not None and answered_nonce(call) != up_nonce:
                    raise NotOurScheduler(address)
                # NOTE: SERVING means one worker is in; the others may still be loading their model.
                if answer.status == health_pb2.HealthCheckResponse.SERVING and \
                        len(generation.GetModelInfo(generate_pb2.GetModelInfoRequest(), timeout=1,
                                                    metadata=metadata).workers) >= num_workers:
                    return True
            except grpc.RpcError:
                pass
            time.sleep(0.2)
    raise TimeoutError(f"{address} not healthy with {num_workers} worker(s) after {timeout:.0f} s")


def answered_nonce(call) -> str | None:
    """The `up` nonce a health check's answer (`call`) came with: its scheduler's (scheduler_svc.server.UpHealth)."""
    return next((v for k, v in call.trailing_metadata() or () if k == UP_NONCE_METADATA), None)


def core_shares(cores: list[int], num_workers: int) -> list[list[int]]:
    """Splits the cores `up` may use among its workers, disjoint while there are enough (no oversubscription);
    with more workers than cores, each worker gets one core, round robin."""
    if num_workers <= len(cores):
        return [cores[i * len(cores) // num_workers:(i + 1) * len(cores) // num_workers] for i in range(num_workers)]
    return [[cores[i % len(cores)]] for i in range(num_workers)]


def visible_gpus() -> int:
    """How many GPUs the workers will see, counted in a child process (keeps torch and CUDA out of `up`)."""
    try:
        out = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.device_count() "
                              "if torch.cuda.is_available() else 0)"], stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL, text=True, timeout=120)
        return int(out.stdout.split()[-1]) if out.returncode == 0 else 0
    except (subprocess.TimeoutExpired, ValueError, IndexError, OSError):
        return 0


def worker_devices(device: str, num_workers: int, num_gpus: int) -> list[str]:
    """Each worker's --device: plain cuda spreads the workers over the GPUs round robin (worker i on
    cuda:{i % num_gpus}); cpu and cuda:N are the same for all."""
    if device != "cuda":
        return [device] * num_workers
    if num_gpus < 1:
        raise ValueError("--device cuda, but no GPU is visible")
    return [f"cuda:{i % num_gpus}" for i in range(num_workers)]


def restart_delay(lived: float, last_delay: float) -> float:
    """Seconds to wait before restarting a child that died `lived` seconds after it started, `last_delay` being the
    wait before that start (0 for none). A child that lived long is restarted at once; one that keeps dying right
    after starting (a crash loop) waits 1, 2, 4, ... up to 30 s."""
    if lived >= CRASH_LOOP_SECONDS:
        return 0.0
    return min(MAX_BACKOFF, max(FIRST_BACKOFF, 2 * last_delay))


def describe_exit(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit code {returncode}"


def child_setup(cores: list[int] | None) -> Callable[[], None]:
    """The preexec function of a child: SIGTERM when `up` dies (Linux), then its share of the cores (if any).
    Runs in the forked child, before exec; the child is already in a session of its own (start_new_session)."""
    parent = os.getpid()
    libc = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None  # loaded before fork

    def setup() -> None:
        if libc is not None:
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
            if os.getppid() != parent:  # `up` died before prctl took effect
                os.kill(os.getpid(), signal.SIGTERM)
        if cores is not None:
            os.sched_setaffinity(0, cores)
    return setup


@dataclass
class Child:
    name: str  # "scheduler" or "worker-I": the `process` of its log lines
    cmd: list[str]
    relay: Relay  # its stderr goes there, line by line
    cores: list[int] | None = None
    proc: subprocess.Popen | None = None
    started: float = 0.0
    delay: float = 0.0  # the back-off before its latest start
    restart_at: float = 0.0  # while dead: when to start it again
    reader: threading.Thread | None = None  # relays its stderr (Relay.follow)
    env: dict[str, str] = field(default_factory=dict)  # on top of Relay.child_env: up's nonce (UP_NONCE_VARIABLE)

    def start(self) -> None:
        self.proc = subprocess.Popen(self.cmd, start_new_session=True, preexec_fn=child_setup(self.cores),
                                     stderr=subprocess.PIPE, env={**self.relay.child_env(), **self.env})
        self.reader = self.relay.follow(self.name, self.proc.stderr)
        self.started = time.monotonic()

    def drained(self, timeout: float = 5.0) -> None:
        """Waits (a while) until its stderr has been relayed to the end: its last lines are out, its error known."""
        if self.reader is not None:
            self.reader.join(timeout)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def watch(self, now: float) -> None:
        """Notices a death (logs it, schedules the restart) and restarts when the back-off is over."""
        if self.proc is not None and (code := self.proc.poll()) is not None:
            self.delay = restart_delay(now - self.started, self.delay)
            self.relay.say(f"{self.name} (pid {self.proc.pid}) died ({describe_exit(code)}); restarting"
                           + (f" in {self.delay:.0f} s" if self.delay else ""), "warning")
            self.proc, self.restart_at = None, now + self.delay
        if self.proc is None and now >= self.restart_at:
            self.start()

    def stop(self, signum: int = signal.SIGTERM) -> None:
        if self.alive():
            self.proc.send_signal(signum)

    def wait(self, deadline: float) -> None:
        """Waits for it to exit until `deadline` (monotonic), then SIGKILLs it; it is reaped either way."""
        if self.proc is None:
            return
        try:
            self.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.relay.say(f"{self.name} (pid {self.proc.pid}) did not stop in time; killing it", "warning")
            self.proc.kill()
            self.proc.wait()


def stop_in_order(scheduler: Child, workers: list[Child], drain_timeout: float) -> None:
    """The scheduler first: it stops admitting and drains its streams, which need the workers; then the workers
    (which would otherwise wait to reconnect)."""
    say = scheduler.relay.say
    if scheduler.alive():
        say("draining the scheduler")
        scheduler.stop()
        scheduler.wait(time.monotonic() + drain_timeout + STOP_MARGIN)
    say("stopping workers")
    for w in workers:
        w.stop()
    deadline = time.monotonic() + STOP_MARGIN
    for w in workers:
        w.wait(deadline)
    for c in (scheduler, *workers):
        c.drained()
    say("stopped")


def run(args: argparse.Namespace) -> int:
    """`up`; a start-up failure (its own, or a child's) ends it with one line, JSON when stderr is no terminal."""
    relay = Relay()  # NOTE: a bad PAGEDSERVE_LOG_FORMAT raises here, before anything starts
    try:
        return serve(args, relay)
    except StartupError as e:
        relay.say(str(e), "error")
        return e.exit_code
    except (ValueError, FileNotFoundError, KeyError) as e:  # NOTE: as pagedserve_cli.main reports them
        relay.say(str(e), "error")
        return USAGE
    except ModelFetchError as e:  # the model could not be had (offline, no such repo)
        relay.say(str(e), "error")
        return 1


def make_children(args: argparse.Namespace, relay: Relay, tls: access_args.UpTls,
                  up_nonce: str) -> tuple[Child, list[Child], list[str]]:
    """The scheduler, the workers (not started yet) and the workers' devices. Each child gets `up_nonce` in its
    environment: the scheduler answers health checks with it and refuses a worker of another `up` (one with another
    nonce), so that this `up` reports its own scheduler and its workers attach to no other."""
    exe, env = [sys.executable, "-m", "pagedserve_cli.main"], {UP_NONCE_VARIABLE: up_nonce}
    num_gpus = visible_gpus() if args.device in (None, "cuda") else 0
    device = args.device or ("cuda" if num_gpus else "cpu")
    devices = worker_devices(device, args.workers, num_gpus)
    # NOTE: a CPU worker is pinned to its share, so its default thread count is that share's size.
    shares = core_shares(sorted(os.sched_getaffinity(0)), args.workers) \
        if hasattr(os, "sched_getaffinity") and device == "cpu" else [None] * args.workers
    scheduler = Child("scheduler", [*exe, "scheduler", *scheduler_argv(args)], relay, env=env)
    workers = [Child(f"worker-{i}", [*exe, "worker", *worker_argv(args, dev), *tls.worker_argv], relay, share,
                     env=env)
               for i, (dev, share) in enumerate(zip(devices, shares))]
    return scheduler, workers, devices


def wait_started(args: argparse.Namespace, children: list[Child], tls: access_args.UpTls, up_nonce: str,
                 stopping: Callable[[], bool]) -> bool:
    """wait_healthy on up's own scheduler (`up_nonce`), its failures as StartupErrors; False if stopped first.
    Start-up fails fast if a service exits: that is usually a configuration error, not worth retrying."""
    try:
        return wait_healthy(args.listen, args.startup_timeout, [c.proc for c in children], stopping, args.workers,
                            tls.credentials, tls.server_name, tls.metadata, up_nonce)
    except TimeoutError as e:
        raise StartupError(f"--startup-timeout {args.startup_timeout:g}: {e} (a slow model load or pull: pass "
                           f"a longer --startup-timeout)") from None
    except NotOurScheduler as e:
        raise StartupError(f"--listen {e}: pass another --listen HOST:PORT, or stop the other") from None
    except ChildExited as e:
        child = next(c for c in children if c.proc is e.proc)
        child.drained()
        why = child.relay.last_error.get(child.name, "see its log above")
        raise StartupError(f"{child.name} exited during start-up ({describe_exit(e.proc.returncode)}): "
                           f"{why}") from None


def own_worker_token(args: argparse.Namespace) -> None:
    """A fresh worker token for this start, in a file only this user reads, given to the scheduler and to up's own
    workers, when nothing else authenticates its loopback worker port. NOTE: loopback is not private: any local
    process (any Unix user) could otherwise attach as a worker, read other clients' prompts and choose their
    replies. A worker added by hand needs the user's own --worker-token-file, given to `up` too. Not for a port
    other hosts reach (its workers could not have the token: the start-up check asks for one of the user's), nor
    under mutual TLS (the certificate authenticates)."""
    from scheduler_svc.worker_auth import loopback_only  # NOTE: here: `pagedserve worker` imports this module

    if not args.worker_token_file and not args.tls_ca and loopback_only(args.worker_listen):
        args.worker_token_file = private_file("worker-token", worker_token_cmd.token_file().decode())


def serve(args: argparse.Namespace, relay: Relay) -> int:
    own_worker_token(args)
    tls = access_args.up_tls(args)  # first: a bad file fails before anything starts
    check_ports_free(args)  # NOTE: before the model pull and the GPU count, which start processes of their own
    # NOTE: pulled once, up front (the children then find it in the cache); a Hub repo's children get the commit
    # it resolved to, so that the scheduler's tokenizer and every worker's weights are one snapshot.
    path = model_dir(args.model, args.revision, relay)
    if path != args.model:
        args.revision = snapshot_commit(path) or args.revision
    stopping = False
    wake_r, wake_w = os.pipe()  # the handler writes a byte, so the main loop's select wakes at once
    os.set_blocking(wake_w, False)

    def stop(*_):
        nonlocal stopping
        stopping = True
        try:
            os.write(wake_w, b"x")
        except BlockingIOError:  # the pipe is full: the loop is awake anyway
            pass

    # NOTE: handlers go in before the first child starts, so a signal never leaves orphans behind.
    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    up_nonce = secrets.token_hex(16)  # this `up`'s mark on its children (make_children)
    scheduler, workers, devices = make_children(args, relay, tls, up_nonce)
    children = [scheduler, *workers]
    try:
        for c in children:
            c.start()
        if not wait_started(args, children, tls, up_nonce, lambda: stopping):
            return 0
        on = ", ".join(dict.fromkeys(devices))
        scheme = "https" if args.tls_cert else "http"
        http = f"OpenAI-compatible API {scheme}://{args.http}/v1, " if args.http else ""
        metrics = f"metrics http://{args.metrics}/metrics" if args.metrics else "no metrics"
        print(f"pagedserve is up: {args.listen} ({args.workers} worker(s) on {on}, {http}{metrics})", flush=True)
        while not stopping:
            now = time.monotonic()
            for c in children:
                c.watch(now)
            select.select([wake_r], [], [], 0.2)
    finally:
        drain = args.drain_timeout if args.drain_timeout is not None else EngineOptions().drain_timeout
        stop_in_order(scheduler, workers, drain)
    return 0
