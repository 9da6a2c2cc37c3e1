"""The HTTP front's connection bounds: a cap on open connections (in all and per peer), request-head and body read timeouts, and a 431 for
an oversized head (uvicorn's h11 protocol, extended)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from http import HTTPStatus

import h11
import structlog
from uvicorn.protocols.http.h11_impl import H11Protocol

from pagedserve_common.descriptors import EveryInterval
from scheduler_svc.http.convert import error_body
from scheduler_svc.peers import PeerCounts, peer_host, peer_key

log = structlog.get_logger("pagedserve.http")

MAX_HEAD_BYTES = 64 << 10  # a request line and headers beyond this get 431 (h11's limit on an incomplete event)
# NOTE: a refusal (503, 408, 431, 400) is written, then what the client still sends is read and dropped until it
# has been quiet LINGER_IDLE seconds (new bytes extend that for LINGER_MAX at most) before the close: closing with
# unread bytes would make the kernel send a reset, which can destroy the answer before the client reads it
# (scheduler_svc.http.limits does the same for a 413).
LINGER_IDLE = 0.5
LINGER_MAX = 5.0
# NOTE: refusals lingering at once, beyond which a connection over the cap is closed at once without an answer: a
# client opening connections as fast as it can must not turn the refusals themselves into held descriptors.
MAX_LINGERING = 64


@dataclass(slots=True)
class ConnectionLimits:
    """The bounds of every connection of one HTTP server, and its counts (shared by its connections)."""

    max_connections: int  # --max-http-connections
    header_timeout: float  # --header-timeout: seconds from a connection's start (or its last answer) to a whole head
    body_timeout: float  # --body-timeout: seconds a request body may go without a byte
    peers: PeerCounts = field(default_factory=lambda: PeerCounts(None))  # served connections per peer
    num_open: int = 0  # connections served (not those being refused)
    num_lingering: int = 0
    closures: EveryInterval = field(default_factory=EveryInterval)

    def closed(self, reason: str) -> None:
        self.closures.note(reason, lambda count: log.info("HTTP connections closed", reason=reason, count=count,
                                                          open=self.num_open, interval_s=self.closures.interval))


def raw_response(status: int, message: str, extra: str = "") -> bytes:
    """A whole HTTP/1.1 answer that closes the connection, its body in OpenAI's error shape."""
    body = json.dumps(error_body(status, message)).encode()
    head = (f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n{extra}\r\n")
    return head.encode() + body


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with the bounds of ConnectionLimits. NOTE: uvicorn times out only an idle keep-alive
    connection; one that never sends a whole head (slowloris) or stops in its body would otherwise stay forever."""

    def __init__(self, *args, limits: ConnectionLimits, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.limits = limits
        self._counted: str | None = None  # its peer's key while it is one of limits.num_open
        self._lingering = False
        self._linger_until = 0.0
        self._phase: str | None = None  # "head" or "body" while its timer runs
        self._timer = None
        self._error: h11.RemoteProtocolError | None = None
        next_event = self.conn.next_event

        def next_event_noting_errors():  # NOTE: uvicorn answers any protocol error 400 without looking at it
            try:
                return next_event()
            except h11.RemoteProtocolError as e:
                self._error = e
                raise

        self.conn.next_event = next_event_noting_errors

    # -- the cap ------------------------------------------------------------------------------------------------
    def connection_made(self, transport) -> None:
        limits = self.limits
        if limits.num_open >= limits.max_connections:
            self._refuse_over(transport, "--max-http-connections", f"the server has {limits.num_open} open HTTP "
                                                                   f"connections, its limit")
            return
        key = peer_key(peer_host(transport.get_extra_info("peername")))
        if not limits.peers.admit(key):
            self._refuse_over(transport, "--max-connections-per-peer", f"this address holds "
                                                                       f"{limits.peers.max_per_peer} open HTTP "
                                                                       f"connections, the most one peer may")
            return
        limits.num_open += 1
        self._counted = key
        super().connection_made(transport)
        self._update_timer()

    def _refuse_over(self, transport, flag: str, why: str) -> None:
        """A connection over a cap (`flag`'s): 503, unless too many refusals linger already (then closed at once)."""
        self.transport = transport
        self.limits.closed(f"over {flag}")
        if self.limits.num_lingering >= MAX_LINGERING:
            transport.close()
            return
        self._refuse(503, f"{why} ({flag}); retry later", "retry-after: 1\r\n")

    def connection_lost(self, exc) -> None:
        self._cancel_timer()
        if self._counted is not None:
            self.limits.peers.release(self._counted)
            self._counted = None
            self.limits.num_open -= 1
        if self._lingering:
            self._lingering = False
            self.limits.num_lingering -= 1
        super().connection_lost(exc)

    # -- read timeouts ------------------------------------------------------------------------------------------
    def data_received(self, data: bytes) -> None:
        if self._lingering:
            if self.loop.time() < self._linger_until:
                self._arm(LINGER_IDLE, self.transport.close)
            return
        super().data_received(data)

    def handle_events(self) -> None:
        super().handle_events()
        self._update_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._update_timer()

    def _update_timer(self) -> None:
        """A head timer from the moment the client owes a request head (not re-armed by each byte: a total bound);
        a body timer re-armed by each byte while it owes body; none while a response is being made or streamed."""
        if self._lingering:
            return
        state = self.conn.their_state
        phase = "head" if state is h11.IDLE and self.cycle_done else "body" if state is h11.SEND_BODY else None
        if self.transport is None or self.transport.is_closing() or phase is None:
            self._cancel_timer()
        elif phase == "body":
            self._arm(self.limits.body_timeout, self._body_timed_out)
        elif self._phase != "head":
            self._arm(self.limits.header_timeout, self._head_timed_out)
        self._phase = phase

    @property
    def cycle_done(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def _head_timed_out(self) -> None:
        if self.transport.is_closing() or not self.cycle_done:
            return
        self.limits.closed("--header-timeout")
        if not self.conn.trailing_data[0]:  # NOTE: not a byte of a next request: a plain close, as for keep-alive
            self.transport.close()
            return
        self._refuse(408, f"the request head did not arrive within {self.limits.header_timeout:g} s "
                          f"(--header-timeout)")

    def _body_timed_out(self) -> None:
        if self.transport.is_closing():
            return
        if self.flow.read_paused:  # NOTE: the app is not reading: our stall, not the client's
            self._arm(self.limits.body_timeout, self._body_timed_out)
            return
        # NOTE: the app is reading the body, so its answer is its own: the connection just closes (the app sees a
        # disconnect)
        self.limits.closed("--body-timeout")
        self.transport.close()

    # -- protocol errors: 431 for an oversized head --------------------------------------------------------------
    def send_400_response(self, msg: str) -> None:
        status = getattr(self._error, "error_status_hint", 400)
        if status == 431:
            message = f"the request head is larger than {MAX_HEAD_BYTES} bytes"
        else:
            status, message = 400, f"invalid HTTP request: {self._error or msg}"
        self.limits.closed(f"HTTP {status}")
        self._refuse(status, message)

    # -- refusing and lingering ---------------------------------------------------------------------------------
    def _refuse(self, status: int, message: str, extra: str = "") -> None:
        """Writes the answer, then lingers until the client is quiet, then closes."""
        self._cancel_timer()
        self.transport.write(raw_response(status, message, extra))
        self._lingering = True
        self.limits.num_lingering += 1
        self._linger_until = self.loop.time() + LINGER_MAX
        self._arm(LINGER_IDLE, self.transport.close)

    def _arm(self, delay: float, callback) -> None:
        self._cancel_timer()
        self._timer = self.loop.call_later(delay, callback)

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
