"""Which network interface carries a node's cluster address (read on the node with `ip`).

gloo and NCCL pick an interface by themselves when GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME are
unset, often the first non-loopback one (a docker bridge, a private VLAN) or whatever the
hostname resolves to, and the peers then wait on an address they cannot reach until the
rendezvous times out. We name the interface explicitly: the one holding the address the
cluster reaches the node by; when that address is not on the node (a provider's 1:1 NAT), the
one the node routes to the head through.
"""

from __future__ import annotations

import ipaddress
import shlex
from dataclasses import dataclass

from vpscluster.errors import RemoteError


@dataclass(frozen=True)
class InterfaceChoice:
    name: str
    address: str  # the address found on that interface
    how: str  # "address" (the node's address is on it) or "route" (the route to the head uses it)


def parse_ip_addr(text: str) -> list[tuple[str, str]]:
    """`ip -o addr` output -> [(interface, address)], both IPv4 and IPv6, in order."""
    out = []
    for line in text.splitlines():
        words = line.split()
        # "4: eth0    inet 192.0.2.2/24 brd ... scope global eth0\ ..."
        if len(words) < 4 or not words[0].endswith(":") or words[2] not in ("inet", "inet6"):
            continue
        name = words[1].split("@", 1)[0]
        out.append((name, words[3].split("/", 1)[0]))
    return out


def interface_for_address(text: str, address: str) -> str | None:
    """The interface holding `address` in `ip -o addr` output, or None."""
    try:
        wanted = ipaddress.ip_address(address)
    except ValueError:
        return None  # a DNS name: never resolved on the node; use the route instead
    for name, found in parse_ip_addr(text):
        try:
            if ipaddress.ip_address(found.split("%", 1)[0]) == wanted:
                return name
        except ValueError:
            continue
    return None


def parse_route_get(text: str) -> tuple[str | None, str | None]:
    """`ip -o route get ADDR` output -> (device, source address)."""
    words = text.split()
    dev = words[words.index("dev") + 1] if "dev" in words[:-1] else None
    src = words[words.index("src") + 1] if "src" in words[:-1] else None
    return dev, src


def choose_interface(ip_addr_text: str, route_text: str, address: str) -> InterfaceChoice | None:
    """The address's own interface; else the device of the route towards the head."""
    name = interface_for_address(ip_addr_text, address)
    if name:
        return InterfaceChoice(name, address, "address")
    dev, src = parse_route_get(route_text)
    if dev:
        return InterfaceChoice(dev, src or "", "route")
    return None


async def find_interface(executor, address: str, head_address: str, timeout_s: float) -> InterfaceChoice:
    """Ask the node (`ip -o addr`, `ip -o route get HEAD`); RemoteError naming it on failure."""
    node = executor.node.name
    sep = "--vpscluster-route--"
    cmd = f"ip -o addr && echo {sep} && (ip -o route get {shlex.quote(head_address)} || true)"
    result = await executor.run(cmd, timeout_s=timeout_s)
    if not result.ok:
        raise RemoteError(f"node {node}: could not list its network interfaces with `ip -o addr`: {result.reason()}")
    addr_text, _, route_text = result.stdout.partition(sep)
    choice = choose_interface(addr_text, route_text, address)
    if choice is None:
        raise RemoteError(
            f"node {node}: no interface carries {address} and no route to the head {head_address}; "
            "check the node's host address in the cluster file"
        )
    return choice
