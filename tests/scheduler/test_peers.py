"""What one peer is, and its connections counted (scheduler_svc.peers): the per-peer caps of every port."""

from __future__ import annotations

import pytest

from scheduler_svc.peers import PeerCounts, peer_host, peer_key


@pytest.mark.parametrize("host, key", [
    ("203.0.113.7", "203.0.113.7"),
    ("2001:db8:1:2:aaaa::1", "2001:db8:1:2::/64"),  # one host holds a whole /64
    ("2001:db8:1:2:ffff:ffff:ffff:ffff", "2001:db8:1:2::/64"),
    ("2001:db8:1:3::1", "2001:db8:1:3::/64"),
    ("::ffff:198.51.100.9", "198.51.100.9"),  # an IPv4 client of a dual-stack port is its IPv4 address
    ("fe80::1%eth0", "fe80::/64"),
    ("", ""),  # a Unix socket: one peer
])
def test_a_peer_is_an_ipv4_address_or_an_ipv6_slash_64(host, key):
    assert peer_key(host) == key


def test_peer_host_of_tcp_and_unix_peernames():
    assert peer_host(("10.0.0.1", 5000)) == "10.0.0.1"
    assert peer_host(("::1", 5000, 0, 0)) == "::1"
    assert peer_host("") == "" and peer_host(None) == ""


def test_a_peer_holds_at_most_its_cap_and_its_count_goes_when_its_connections_do():
    peers = PeerCounts(max_per_peer=2)
    assert [peers.admit("a") for _ in range(3)] == [True, True, False]  # the third is refused, not counted
    assert peers.admit("b")  # another peer is not the price
    assert peers.counts == {"a": 2, "b": 1}
    peers.release("a")
    assert peers.admit("a")
    for key in ("a", "a", "b"):
        peers.release(key)
    assert peers.counts == {}  # a peer that has gone costs nothing


def test_no_cap_counts_all():
    peers = PeerCounts(max_per_peer=None)
    assert all(peers.admit("a") for _ in range(10_000))
    assert peers.counts == {"a": 10_000}
