"""Which interface carries a node's address: parsing `ip -o addr` / `ip route get`, and asking a node."""

from __future__ import annotations

import asyncio
import sys

import pytest

from vpscluster.cluster.local import LocalExecutor
from vpscluster.cluster.node import Node
from vpscluster.errors import RemoteError
from vpscluster.launch.netif import (
    choose_interface, find_interface, interface_for_address, parse_ip_addr, parse_route_get,
)

IP_ADDR = """\
1: lo    inet 127.0.0.1/8 scope host lo\\       valid_lft forever preferred_lft forever
1: lo    inet6 ::1/128 scope host \\       valid_lft forever preferred_lft forever
2: docker0    inet 172.17.0.1/16 brd 172.17.255.255 scope global docker0\\       valid_lft forever preferred_lft forever
3: ens3    inet 10.0.0.5/24 brd 10.0.0.255 scope global ens3\\       valid_lft forever preferred_lft forever
3: ens3    inet6 2001:db8::5/64 scope global \\       valid_lft forever preferred_lft forever
7: vps1a@if6    inet 10.231.0.2/24 scope global vps1a\\       valid_lft forever preferred_lft forever
"""


def test_parse_ip_addr_lists_v4_and_v6_and_strips_peer_suffix():
    pairs = parse_ip_addr(IP_ADDR)
    assert ("ens3", "10.0.0.5") in pairs and ("ens3", "2001:db8::5") in pairs
    assert ("vps1a", "10.231.0.2") in pairs
    assert len(pairs) == 6


@pytest.mark.parametrize("address,expected", [
    ("10.0.0.5", "ens3"), ("2001:db8:0::5", "ens3"), ("127.0.0.1", "lo"), ("10.231.0.2", "vps1a"),
    ("203.0.113.9", None), ("node-a.example.com", None),
])
def test_interface_for_address(address, expected):
    assert interface_for_address(IP_ADDR, address) == expected


def test_route_fallback_when_the_address_is_not_on_the_node():
    route = "198.51.100.7 via 10.0.0.1 dev ens3 src 10.0.0.5 uid 0 \\    cache"
    assert parse_route_get(route) == ("ens3", "10.0.0.5")
    choice = choose_interface(IP_ADDR, route, "203.0.113.9")  # a provider's 1:1 NAT address
    assert (choice.name, choice.address, choice.how) == ("ens3", "10.0.0.5", "route")
    assert choose_interface(IP_ADDR, route, "10.0.0.5").how == "address"
    assert choose_interface(IP_ADDR, "", "203.0.113.9") is None


def test_find_interface_asks_the_node():
    ex = LocalExecutor(Node(name="here", host="127.0.0.1", local=True, python=sys.executable))
    choice = asyncio.run(find_interface(ex, "127.0.0.1", "127.0.0.1", timeout_s=10))
    assert choice.name == "lo" and choice.how == "address"


def test_find_interface_names_the_node_when_ip_fails(monkeypatch):
    ex = LocalExecutor(Node(name="broken", host="127.0.0.1", local=True, python=sys.executable))
    monkeypatch.setenv("PATH", "/nonexistent")  # no `ip` on this "node"
    with pytest.raises(RemoteError, match="node broken: could not list its network interfaces"):
        asyncio.run(find_interface(ex, "127.0.0.1", "127.0.0.1", timeout_s=10))


def test_addresses_are_resolved_on_the_launcher_never_on_nodes():
    from vpscluster.errors import UserError
    from vpscluster.launch.preflight import resolve_address

    assert resolve_address("203.0.113.10") == "203.0.113.10"
    assert resolve_address("2001:db8::1") == "2001:db8::1"
    assert resolve_address("localhost") in ("127.0.0.1", "::1")
    with pytest.raises(UserError, match="put its IP address in the cluster file"):
        resolve_address("no-such-host.invalid")
