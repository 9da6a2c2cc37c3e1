"""A gRPC port behind its ConnectionGate: one peer's connections over --max-connections-per-peer are closed at once,
the others are relayed byte for byte (a server stream, a large message both ways), and the servicer sees the
client's own address. A real grpc server and gate on loopback; clients dial from two peers, 127.0.0.1 and
127.0.0.2."""

from __future__ import annotations

import asyncio

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from pagedserve_common.ports import free_port
from scheduler_svc.connection_gate import INTERNAL_HOST, ClientSide, ConnectionGate

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])
ECHO = "/test.Echo/Echo"


class Gated:
    """A grpc server (health, and an echo of bytes that records the peer it saw) behind a gate."""

    def __init__(self, max_per_peer: int, max_connections: int = 64) -> None:
        self.max_per_peer, self.max_connections = max_per_peer, max_connections
        self.peers_seen: list[tuple[str, str]] = []  # (grpc's peer: the relay's, the client's)

    async def __aenter__(self) -> Gated:
        self.address = f"127.0.0.1:{free_port()}"
        self.gate = ConnectionGate.bind("--listen", self.address, self.max_connections, self.max_per_peer)
        self.server = grpc.aio.server(options=(("grpc.max_receive_message_length", 64 << 20),))
        health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), self.server)

        async def echo(request: bytes, context) -> bytes:
            self.peers_seen.append((context.peer(), self.gate.original_peer(context.peer())))
            return request

        handler = grpc.unary_unary_rpc_method_handler(echo)
        self.server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("test.Echo", {"Echo": handler}),))
        self.gate.grpc_port = self.server.add_insecure_port(f"{INTERNAL_HOST}:0")
        await self.server.start()
        await self.gate.start()
        return self

    async def __aexit__(self, *exc) -> None:
        self.gate.close()
        await self.server.stop(0)


async def held(address: str, source: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    host, port = address.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port), local_addr=(source, 0))
    writer.write(PREFACE)
    return reader, writer


async def closed_within(reader: asyncio.StreamReader, seconds: float) -> bool:
    try:
        async with asyncio.timeout(seconds):
            while await reader.read(65536):
                pass
        return True
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True


def test_one_peer_over_its_cap_is_closed_at_once_and_another_peer_is_served():
    async def main():
        async with Gated(max_per_peer=2) as g:
            first = [await held(g.address, "127.0.0.2") for _ in range(2)]
            over = await held(g.address, "127.0.0.2")
            assert await closed_within(over[0], 10)  # the third of 127.0.0.2: closed at once
            assert g.gate.peers.counts == {"127.0.0.2": 2}
            assert not await closed_within(first[0][0], 0.5)  # the two within the cap stay
            async with grpc.aio.insecure_channel(g.address) as ch:  # 127.0.0.1: another peer
                answer = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=30)
                assert answer.status == health_pb2.HealthCheckResponse.SERVING
                assert g.gate.peers.counts == {"127.0.0.2": 2, "127.0.0.1": 1}
            for _, writer in first:
                writer.close()
            for _ in range(200):  # the gate sees the closes
                if g.gate.peers.counts == {}:
                    break
                await asyncio.sleep(0.05)
            assert g.gate.peers.counts == {} and g.gate.num_open == 0

    asyncio.run(main())


def test_the_port_cap_holds_in_all_whatever_the_peers():
    async def main():
        async with Gated(max_per_peer=8, max_connections=3) as g:
            kept = [await held(g.address, f"127.0.0.{i}") for i in (2, 3, 4)]
            over = await held(g.address, "127.0.0.5")
            assert await closed_within(over[0], 10)
            assert g.gate.num_open == 3
            for _, writer in kept:
                writer.close()

    asyncio.run(main())


def test_relayed_bytes_arrive_whole_both_ways_and_the_servicer_sees_the_clients_address():
    payload = bytes(range(256)) * (32 << 12)  # 32 MiB: many chunks, the relay's flow control at work

    async def main():
        async with Gated(max_per_peer=2) as g:
            async with grpc.aio.insecure_channel(g.address, options=(("grpc.max_receive_message_length",
                                                                       64 << 20),)) as ch:
                echo = ch.unary_unary(ECHO)
                assert await echo(payload, timeout=120) == payload
                assert await echo(b"x", timeout=60) == b"x"
            (relay, client), _ = g.peers_seen
            assert relay.startswith("ipv4:127.0.0.1:") and client.startswith("ipv4:127.0.0.1:")
            assert relay != client  # the relay's own port, told apart from the client's
            assert g.peers_seen[1][1] == client  # one connection for both calls

    asyncio.run(main())


class _GoneTransport:
    """A client's transport whose peer has gone while grpc's side ended (shutdown(SHUT_WR) gets ENOTCONN)."""

    def __init__(self) -> None:
        self.closed = False

    def is_closing(self) -> bool:
        return self.closed

    def can_write_eof(self) -> bool:
        return True

    def write_eof(self) -> None:
        raise OSError(107, "Transport endpoint is not connected")

    def close(self) -> None:
        self.closed = True


def test_grpc_ending_a_connection_whose_client_is_gone_closes_it_without_an_error():
    """Seen at shutdown: a worker and the scheduler end one connection at once; the FIN then finds no peer. That is
    the end of the connection, not an exception in the event loop's callback (a traceback in the log)."""
    async def scenario():
        client = ClientSide(gate=None)
        client.transport = _GoneTransport()
        client.linger()
        assert client.transport.closed and client.timer is None and client.linger_until is None
    asyncio.run(scenario())
