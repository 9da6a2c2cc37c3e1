"""Listening sockets bound here (a taken port fails the start with a clear error) and accepting without a storm of
retries when descriptors run out: the HTTP front's and the gRPC ports' connection gates."""

from __future__ import annotations

import errno
import ipaddress
import socket

from pagedserve_common.descriptors import OUT_OF_RESOURCE_ERRNOS
from pagedserve_common.startup import bind_failure, host_port

LISTEN_BACKLOG = 2048  # uvicorn's: connections the kernel holds before this process accepts them


class Listener(socket.socket):
    """A listening socket. NOTE: after an accept() that fails for want of descriptors, asyncio (3.11) tries again
    up to `backlog` times in the same tick and schedules a retry a second later for each failure; those retries
    each do the same, so the failures multiply (the issue saw 785,622 in 70 s). Raising BlockingIOError for the
    attempt after a failure makes asyncio stop the burst (it reads it as "nothing to accept"): one attempt and one
    retry a second."""

    def accept(self):
        if getattr(self, "failed", False):
            self.failed = False
            raise BlockingIOError(errno.EAGAIN, "backing off after an accept() failure")
        try:
            return super().accept()
        except OSError as e:
            self.failed = e.errno in OUT_OF_RESOURCE_ERRNOS
            raise

    @classmethod
    def of(cls, bound: socket.socket) -> Listener:
        return cls(bound.family, bound.type, bound.proto, fileno=bound.detach())


def bind_all(flag: str, address: str, default_host: str = "", off: bool = False) -> list[Listener]:
    """Listening sockets on every address HOST:PORT `address` resolves to, as gRPC listens ('localhost': 127.0.0.1
    and ::1; '[::]' dual-stack); port 0 picks one port for all. A failure is bind_failure's StartupError."""
    host, port = host_port(flag, address)
    try:
        infos = socket.getaddrinfo(host or default_host or None, port, type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise bind_failure(flag, address, OSError(e.errno, e.strerror), off=off) from None
    listeners: list[Listener] = []
    try:
        for family, kind, proto, _, where in dict.fromkeys(infos):
            s = socket.socket(family, kind, proto)
            try:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if family == socket.AF_INET6:
                    unspecified = ipaddress.ip_address(where[0].split("%")[0]).is_unspecified
                    s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0 if unspecified else 1)
                if listeners and where[1] == 0:
                    where = (where[0], listeners[0].getsockname()[1], *where[2:])
                s.bind(where)
                s.listen(LISTEN_BACKLOG)
                s.setblocking(False)
            except OSError:
                s.close()
                raise
            listeners.append(Listener.of(s))
    except OSError as e:
        for s in listeners:
            s.close()
        raise bind_failure(flag, address, e, off=off) from None
    return listeners
