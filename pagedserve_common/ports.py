"""Picking a loopback port for a server that a test, a benchmark or `pagedserve bench --spawn` starts."""

from __future__ import annotations

import random
import socket

_LOWEST = 10000  # NOTE: below the well-known and registered ports that local daemons tend to hold
_handed_out: set[int] = set()


def _lowest_ephemeral() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_port(host: str = "127.0.0.1") -> int:
    """A port that is free now, for a server about to be started (in another process) to bind.

    NOTE: outside the kernel's ephemeral range, unlike bind(("", 0)): a port from that range can be taken as the
    source port of any outgoing connection (a client's, another test's) in the moment before the server binds it,
    and the server then fails with "address in use". Never the same port twice in one process, so servers started
    together cannot be handed one port."""
    lo = _lowest_ephemeral()
    rng = random.Random()
    if lo - _LOWEST > 1000:
        for _ in range(200):
            port = rng.randrange(_LOWEST, lo)
            if port in _handed_out:
                continue
            with socket.socket() as s:
                try:
                    s.bind((host, port))
                except OSError:
                    continue
            _handed_out.add(port)
            return port
    with socket.socket() as s:  # a machine whose ephemeral range leaves no room below it
        s.bind((host, 0))
        port = s.getsockname()[1]
    _handed_out.add(port)
    return port
