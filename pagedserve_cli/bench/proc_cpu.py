"""CPU seconds per process from /proc: a server found by its listening port (and its processes), and the client."""

from __future__ import annotations

import ipaddress
import os
import socket
import time
from dataclasses import dataclass, field

CLK_TCK = os.sysconf("SC_CLK_TCK")
LISTEN, ESTABLISHED = "0A", "01"  # /proc/net/tcp st


@dataclass(slots=True, frozen=True)
class TcpSocket:
    local: tuple[str, int]
    remote: tuple[str, int]
    state: str
    inode: int


def _addr(hex_addr: str) -> tuple[str, int]:
    host, port = hex_addr.split(":")
    raw = bytes.fromhex(host)
    # NOTE: the kernel prints each 32-bit word in host (little-endian) order
    raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    return str(ipaddress.ip_address(raw)), int(port, 16)


def tcp_sockets() -> list[TcpSocket]:
    """Every TCP socket of this network namespace (/proc/net/tcp and tcp6)."""
    out = []
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(name, encoding="ascii") as f:
                next(f)
                for line in f:
                    parts = line.split()
                    out.append(TcpSocket(_addr(parts[1]), _addr(parts[2]), parts[3], int(parts[9])))
        except (OSError, StopIteration):
            continue
    return out


def socket_owners() -> dict[int, set[int]]:
    """socket inode -> the pids holding it open (/proc/PID/fd; other users' processes only when we may read them)."""
    owners: dict[int, set[int]] = {}
    for pid in _pids():
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                owners.setdefault(int(target[8:-1]), set()).add(pid)
    return owners


def listening_pids(port: int, sockets: list[TcpSocket] | None = None,
                   owners: dict[int, set[int]] | None = None) -> set[int]:
    """The processes holding a socket that listens on TCP `port` (any address) on this machine."""
    sockets = tcp_sockets() if sockets is None else sockets
    owners = socket_owners() if owners is None else owners
    return {pid for s in sockets if s.state == LISTEN and s.local[1] == port for pid in owners.get(s.inode, ())}


def is_local(host: str, port: int, sockets: list[TcpSocket] | None = None) -> bool:
    """Whether HOST:PORT is a listening socket of this machine (loopback, one of its addresses, or a wildcard
    listener reached by this machine's own name or address)."""
    sockets = tcp_sockets() if sockets is None else sockets
    listening = {s.local[0] for s in sockets if s.state == LISTEN and s.local[1] == port}
    if not listening:
        return False
    try:
        addrs = {ipaddress.ip_address(a[4][0].split("%")[0]) for a in socket.getaddrinfo(host, port)}
    except (socket.gaierror, ValueError):
        return False
    mine = {ipaddress.ip_address(a) for a in listening}
    if any(a.is_loopback for a in addrs) or addrs & mine:
        return True
    if any(a.is_unspecified for a in mine):
        try:
            own = {ipaddress.ip_address(a[4][0].split("%")[0]) for a in socket.getaddrinfo(socket.gethostname(), None)}
        except (socket.gaierror, ValueError):
            own = set()
        return bool(addrs & own)
    return False


def _pids() -> list[int]:
    return [int(d) for d in os.listdir("/proc") if d.isdigit()]


@dataclass(slots=True, frozen=True)
class Stat:
    """The fields of /proc/PID/stat we read: CPU times in seconds (every thread of the process), and the start
    time in ticks since boot (a pid reused by another process has another one)."""

    pid: int
    ppid: int
    cpu_s: float  # utime + stime
    reaped_children_s: float  # cutime + cstime: children that ended and were waited for
    start_ticks: int


def read_stat(pid: int) -> Stat | None:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return Stat(pid, int(fields[1]), (int(fields[11]) + int(fields[12])) / CLK_TCK,
                (int(fields[13]) + int(fields[14])) / CLK_TCK, int(fields[19]))


def cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            raw = f.read()
    except OSError:
        return []
    args = [a.decode(errors="replace") for a in raw.split(b"\0") if a]
    if len(args) == 1 and " " in args[0]:  # setproctitle (vLLM's "VLLM::EngineCore") writes one string
        args = args[0].split()
    return args


def role(args: list[str]) -> str:
    """What a process is, from its command line: pagedserve's up / scheduler / worker, vLLM's api server /
    engine core / worker (the process that runs the model, VLLM::Worker), else "other"."""
    text = " ".join(args)
    if "EngineCore" in text:
        return "engine core"
    if text.startswith("VLLM::Worker"):  # NOTE: vLLM's CPU build runs the model in a process of its own
        return "worker"
    if "vllm.entrypoints" in text or text.startswith("VLLM::APIServer") or \
            (len(args) > 1 and args[0].endswith("vllm") and args[1] == "serve"):
        return "api server"
    for i, a in enumerate(args):
        if a.endswith(("pagedserve", "pagedserve_cli.main", "pagedserve_cli/main.py")):
            # NOTE: the first of the three after the program: global flags (and their values) may come first
            return next((s for s in args[i + 1:] if s in ("up", "scheduler", "worker")), "other")
    return "other"


def children_map() -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for pid in _pids():
        st = read_stat(pid)
        if st is not None:
            out.setdefault(st.ppid, []).append(pid)
    return out


def descendants(roots: set[int], children: dict[int, list[int]] | None = None) -> set[int]:
    """`roots` and every process below them."""
    children = children_map() if children is None else children
    out, todo = set(), list(roots)
    while todo:
        pid = todo.pop()
        if pid not in out:
            out.add(pid)
            todo.extend(children.get(pid, ()))
    return out


def server_roots(port: int) -> set[int]:
    """The processes at the top of the server listening on `port`: the listener, or the `pagedserve up` above it;
    plus any pagedserve worker connected to a port the listener listens on (workers started on their own)."""
    sockets, owners = tcp_sockets(), socket_owners()
    roots = listening_pids(port, sockets, owners)
    for pid in list(roots):
        st = read_stat(pid)
        if st is not None and role(cmdline(st.ppid)) == "up":
            roots.add(st.ppid)
    ports = {s.local[1] for s in sockets if s.state == LISTEN and owners.get(s.inode, set()) & roots}
    me = os.getpid()
    for s in sockets:
        if s.state == ESTABLISHED and s.remote[1] in ports:
            for pid in owners.get(s.inode, ()):
                if pid != me and pid not in roots and role(cmdline(pid)) == "worker":
                    roots.add(pid)
    return roots


@dataclass(slots=True)
class Tracked:
    pid: int
    role: str
    cmdline: str
    start_ticks: int
    first_s: float  # CPU seconds at its first sample (0 for a process born during the watch)
    first_reaped_s: float
    last_s: float
    last_reaped_s: float
    peak_cores: float = 0.0
    gone: bool = False


@dataclass(slots=True)
class CpuWatch:
    """Samples the CPU times of the server's processes (found again each sample, so new children count from 0)
    and of this process (the client). start(), sample() as often as wanted, stop() -> the report."""

    port: int | None  # None: the server is not on this machine
    roots: set[int] = field(default_factory=set)
    procs: dict[int, Tracked] = field(default_factory=dict)
    t0: float = 0.0
    t_last: float = 0.0

    def start(self) -> None:
        self.t0 = self.t_last = time.monotonic()
        if self.port is not None:
            self.roots = server_roots(self.port)
        self._read(first=True)

    def _read(self, first: bool = False) -> None:
        t = time.monotonic()
        dt = t - self.t_last
        pids = descendants(self.roots) if self.roots else set()
        me = os.getpid()
        pids.discard(me)  # NOTE: a bench that spawned the server is its parent, never below it
        seen = set()
        for pid in [*pids, me]:
            st = read_stat(pid)
            if st is None:
                continue
            old = self.procs.get(pid)
            if old is not None and old.start_ticks != st.start_ticks:
                old = None  # a reused pid: a new process
            if old is None:
                args = cmdline(pid)
                base, base_reaped = (st.cpu_s, st.reaped_children_s) if first else (0.0, 0.0)
                old = self.procs[pid] = Tracked(pid, "client" if pid == me else role(args), " ".join(args)[:200],
                                                st.start_ticks, base, base_reaped, st.cpu_s, st.reaped_children_s)
            elif dt > 0:
                old.peak_cores = max(old.peak_cores, (st.cpu_s - old.last_s) / dt)
            old.last_s, old.last_reaped_s = st.cpu_s, st.reaped_children_s
            seen.add(pid)
        for pid, p in self.procs.items():
            p.gone = p.gone or pid not in seen
        self.t_last = t

    def sample(self) -> None:
        self._read()

    def stop(self) -> dict:
        self._read()
        wall = max(self.t_last - self.t0, 1e-9)
        rows = []
        for p in self.procs.values():
            cpu = p.last_s - p.first_s
            rows.append({"pid": p.pid, "role": p.role, "cmdline": p.cmdline, "cpu_s": cpu, "cores": cpu / wall,
                         "peak_cores": p.peak_cores,
                         "reaped_children_cpu_s": p.last_reaped_s - p.first_reaped_s, "ended": p.gone})
        by_role: dict[str, float] = {}
        for r in rows:
            by_role[r["role"]] = by_role.get(r["role"], 0.0) + r["cpu_s"] + r["reaped_children_cpu_s"]
        server = [r for r in rows if r["role"] != "client"]
        return {"local": self.port is not None, "wall_s": wall, "processes": rows, "by_role": by_role,
                "server_cpu_s": sum(r["cpu_s"] + r["reaped_children_cpu_s"] for r in server) if server else None}
