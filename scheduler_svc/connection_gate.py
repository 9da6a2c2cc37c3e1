"""A gRPC port's per-peer connection cap (issue 50). grpc core bounds a port's connections in all and closes idle
ones, but cannot count them per peer: one peer reopening connections as fast as they close would hold the whole
port, and every other client would get UNAVAILABLE. The gate listens at the port's address in grpc's place,
counts each peer's open connections (scheduler_svc.peers), closes one over the cap at once (its client sees
UNAVAILABLE and backs off), and relays the others byte for byte (TLS stays end to end: nothing is decrypted here)
to grpc's own listener on a loopback port.

NOTE: the relay runs on the scheduler's loop, one callback per chunk each way; its cost is measured by
bench/attack.py (the honest stream's inter-token p99 with and without the gate: --max-connections-per-peer 0)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import structlog

from pagedserve_common.descriptors import EveryInterval
from scheduler_svc.listener import Listener, bind_all
from scheduler_svc.peers import PeerCounts, peer_host, peer_key

log = structlog.get_logger("pagedserve.scheduler")

INTERNAL_HOST = "127.0.0.1"  # grpc's own listener behind a gate
UNIX_SCHEMES = ("unix:", "unix-abstract:", "vsock:")  # no peer addresses: no gate
# NOTE: when grpc ends a connection, what it sent last (a TLS alert, a GOAWAY) goes to the client with a FIN, and
# what the client still sends is read and dropped until it is quiet LINGER_IDLE seconds (LINGER_MAX at most) before
# the close: closing with unread bytes makes the kernel send a reset, which can destroy that last answer before the
# client reads it (a worker without a certificate saw "connection reset", not the TLS refusal)
LINGER_IDLE = 0.5
LINGER_MAX = 2.0


@dataclass(slots=True)
class ConnectionGate:
    """The public side of one gRPC port (`flag` names it in logs): max_connections in all, max_per_peer each."""

    flag: str
    listeners: list[Listener]
    max_connections: int
    peers: PeerCounts
    num_open: int = 0
    grpc_port: int = 0  # where grpc listens, on INTERNAL_HOST
    origins: dict[int, str] = field(default_factory=dict)  # the relay's local port -> the client's grpc-style peer
    refusals: EveryInterval = field(default_factory=EveryInterval)
    servers: list[asyncio.Server] = field(default_factory=list)

    @classmethod
    def bind(cls, flag: str, address: str, max_connections: int, max_per_peer: int) -> ConnectionGate:
        """Binds `address` now (a taken port fails the start, naming `flag`); serves from start()."""
        return cls(flag, bind_all(flag, address), max_connections, PeerCounts(max_per_peer))

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        for s in self.listeners:
            self.servers.append(await loop.create_server(lambda: ClientSide(self), sock=s))

    def close(self) -> None:
        for server in self.servers:
            server.close()

    def original_peer(self, peer: str) -> str:
        """The client's address for grpc's `context.peer()` of a relayed connection (ipv4:127.0.0.1:PORT)."""
        _, _, port = peer.rpartition(":")
        return self.origins.get(int(port), peer) if port.isdigit() else peer

    def admit(self, key: str) -> bool:
        if self.num_open >= self.max_connections:
            self.refused(key, f"{self.flag}'s connection cap")
            return False
        if not self.peers.admit(key):
            self.refused(key, "--max-connections-per-peer")
            return False
        self.num_open += 1
        return True

    def release(self, key: str) -> None:
        self.num_open -= 1
        self.peers.release(key)

    def refused(self, key: str, reason: str) -> None:
        self.refusals.note(reason, lambda count: log.info(
            "connections refused", port=self.flag, reason=reason, count=count, peer=key, open=self.num_open,
            peer_open=self.peers.counts.get(key, 0), interval_s=self.refusals.interval))


def grpc_peer(peername: tuple) -> str:
    host, port = peername[0], peername[1]
    return f"ipv6:[{host}]:{port}" if ":" in host else f"ipv4:{host}:{port}"


class ClientSide(asyncio.Protocol):
    """A client's connection: admitted or closed at once; then relayed to grpc. Reading waits for grpc's side."""

    def __init__(self, gate: ConnectionGate) -> None:
        self.gate = gate
        self.transport: asyncio.Transport | None = None
        self.upstream: asyncio.Transport | None = None
        self.key: str | None = None  # counted while set
        self.linger_until: float | None = None  # set once grpc's side has ended: the client's bytes are dropped
        self.timer: asyncio.TimerHandle | None = None
        # NOTE: what the client sent before grpc's side was open: on some Python 3.11 builds (Debian's, in the
        # image) a pause_reading() in connection_made does not hold (the reader is added after it all the same)
        self.early: list[bytes] = []
        self.dialing: asyncio.Task | None = None

    def connection_made(self, transport) -> None:
        self.transport = transport
        peername = transport.get_extra_info("peername")
        key = peer_key(peer_host(peername))
        if not self.gate.admit(key):
            transport.close()
            return
        self.key = key
        transport.pause_reading()  # NOTE: where it holds, nothing comes in before grpc's side is open (self.early)
        # NOTE: held here: the loop keeps only a weak reference to a task
        self.dialing = asyncio.get_running_loop().create_task(
            self._dial(grpc_peer(peername) if isinstance(peername, tuple) else ""))

    async def _dial(self, origin: str) -> None:
        loop = asyncio.get_running_loop()
        try:
            upstream, _ = await loop.create_connection(lambda: GrpcSide(self), INTERNAL_HOST, self.gate.grpc_port)
        except OSError as e:
            self.gate.refused(self.key, f"cannot reach grpc's listener: {e.strerror or e}")
            self.transport.close()
            return
        if self.transport.is_closing():
            upstream.close()
            return
        self.upstream = upstream
        local_port = upstream.get_extra_info("sockname")[1]
        self.gate.origins[local_port] = origin
        for data in self.early:
            upstream.write(data)
        self.early = []
        self.transport.resume_reading()

    def data_received(self, data: bytes) -> None:
        if self.upstream is None and self.linger_until is None:  # grpc's side is still being opened
            self.early.append(data)
            self.transport.pause_reading()
        elif self.linger_until is None:
            self.upstream.write(data)
        elif asyncio.get_running_loop().time() < self.linger_until:
            self._arm(LINGER_IDLE)

    def linger(self) -> None:
        """grpc's side has ended: a FIN after what it sent, then a close once the client is quiet."""
        transport = self.transport
        if transport.is_closing():
            return
        if transport.can_write_eof():
            try:
                transport.write_eof()
            except OSError:  # NOTE: the client is gone already (both ends closed at once: ENOTCONN): just close
                transport.close()
                return
        self.linger_until = asyncio.get_running_loop().time() + LINGER_MAX
        self._arm(LINGER_IDLE)

    def _arm(self, delay: float) -> None:
        if self.timer is not None:
            self.timer.cancel()
        self.timer = asyncio.get_running_loop().call_later(delay, self.transport.close)

    def eof_received(self) -> bool:
        return False  # NOTE: HTTP/2 never half-closes: an end is the end (connection_lost closes the other side)

    def connection_lost(self, exc) -> None:
        if self.timer is not None:
            self.timer.cancel()
        if self.key is not None:
            self.gate.release(self.key)
            self.key = None
        if self.upstream is not None:
            self.upstream.close()

    # NOTE: flow control: a client that does not read stops the relay reading grpc (whose own window then fills)
    def pause_writing(self) -> None:
        if self.upstream is not None:
            self.upstream.pause_reading()

    def resume_writing(self) -> None:
        if self.upstream is not None:
            self.upstream.resume_reading()


class GrpcSide(asyncio.Protocol):
    """The relay's connection to grpc's listener, for one ClientSide."""

    def __init__(self, client: ClientSide) -> None:
        self.client = client
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.client.transport.write(data)

    def eof_received(self) -> bool:
        return False

    def connection_lost(self, exc) -> None:
        sockname = self.transport.get_extra_info("sockname")
        if sockname:
            self.client.gate.origins.pop(sockname[1], None)
        self.client.linger()

    def pause_writing(self) -> None:
        self.client.transport.pause_reading()

    def resume_writing(self) -> None:
        self.client.transport.resume_reading()
