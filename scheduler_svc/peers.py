"""Open connections counted per peer, for the per-peer caps of every port (issue 50): one peer address must not
hold a port, whatever it does; it degrades itself, not everyone."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field

IPV6_PREFIX = 64  # NOTE: one host is given a whole /64: counting its addresses one by one would cap nothing


def peer_key(host: str) -> str:
    """What one peer is: its IPv4 address; an IPv6 address's /64 (an IPv4-mapped one is its IPv4 address); anything
    else (a Unix socket's empty name) one peer."""
    try:
        address = ipaddress.ip_address(host.split("%")[0])
    except ValueError:
        return host
    if address.version == 6:
        if address.ipv4_mapped is not None:
            return str(address.ipv4_mapped)
        return str(ipaddress.ip_network(f"{address}/{IPV6_PREFIX}", strict=False))
    return str(address)


def peer_host(peername) -> str:
    """The host of a transport's `peername` extra info: (host, port[, flow, scope]) for TCP, a path for Unix."""
    return peername[0] if isinstance(peername, tuple) else ""


@dataclass(slots=True)
class PeerCounts:
    """Connections open per peer, and the most one peer may hold (None: no cap). Invariant: a key is present only
    while its count is positive, so a peer that has gone costs nothing."""

    max_per_peer: int | None
    counts: dict[str, int] = field(default_factory=dict)

    def admit(self, key: str) -> bool:
        """Counts one more connection of `key`, unless it holds max_per_peer already (then False, nothing counted)."""
        held = self.counts.get(key, 0)
        if self.max_per_peer is not None and held >= self.max_per_peer:
            return False
        self.counts[key] = held + 1
        return True

    def release(self, key: str) -> None:
        held = self.counts[key] - 1
        if held:
            self.counts[key] = held
        else:
            del self.counts[key]
