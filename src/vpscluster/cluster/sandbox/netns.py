"""Network plumbing of a sandbox: a bridge in the root namespace and one namespace per node.

    root namespace:  vpsbr<tag> (10.231.X.1/24) ── vps<tag>n1 ═╗ veth ╔═ eth0 (10.231.X.2) in vpsc.<name>.node-1
                                                 └ vps<tag>n2 ═╝      ╚═ eth0 (10.231.X.3) in vpsc.<name>.node-2 ...

Node-to-node traffic is bridged (layer 2) and never routed, so ip_forward and rp_filter do not
matter; the bridge opts out of br_netfilter where the kernel lets it, and `up` checks node-to-node
reachability anyway because a FORWARD policy of DROP with bridge-nf-call-iptables=1 would
silently eat it.
"""

from __future__ import annotations

import os
import signal
import time

from vpscluster.cluster.sandbox.system import run_tool

NETNS_DIR = "/run/netns"


def list_namespaces(prefix: str) -> list[str]:
    try:
        return sorted(n for n in os.listdir(NETNS_DIR) if n.startswith(prefix))
    except FileNotFoundError:
        return []


def list_links(prefix: str) -> list[str]:
    out = run_tool(["ip", "-o", "link", "show"], check=False).stdout
    names = []
    for line in out.splitlines():
        # "12: vpsbrabc123: <BROADCAST,...>" or "13: vpsabc123n1@if2: <...>"
        parts = line.split(":", 2)
        if len(parts) >= 2:
            name = parts[1].strip().split("@", 1)[0]
            if name.startswith(prefix):
                names.append(name)
    return names


def create_bridge(bridge: str, gateway_cidr: str) -> None:
    # nf_call_* 0: keep this bridge's frames out of iptables where the global sysctl allows it.
    made = run_tool(["ip", "link", "add", "name", bridge, "type", "bridge",
                     "nf_call_iptables", "0", "nf_call_ip6tables", "0", "nf_call_arptables", "0"], check=False)
    if made.returncode != 0:
        run_tool(["ip", "link", "add", "name", bridge, "type", "bridge"])
    run_tool(["ip", "addr", "add", gateway_cidr, "dev", bridge])
    run_tool(["ip", "link", "set", bridge, "up"])


def create_node(namespace: str, veth: str, peer: str, bridge: str, address_cidr: str) -> None:
    """A namespace with lo up and eth0 at `address_cidr` (created as `peer`), `veth` enslaved to `bridge`."""
    run_tool(["ip", "netns", "add", namespace])
    run_tool(["ip", "link", "add", veth, "type", "veth", "peer", "name", peer])
    run_tool(["ip", "link", "set", peer, "netns", namespace])
    run_tool(["ip", "-n", namespace, "link", "set", peer, "name", "eth0"])
    run_tool(["ip", "-n", namespace, "addr", "add", address_cidr, "dev", "eth0"])
    run_tool(["ip", "-n", namespace, "link", "set", "lo", "up"])
    run_tool(["ip", "-n", namespace, "link", "set", "eth0", "up"])
    run_tool(["ip", "link", "set", veth, "master", bridge])
    run_tool(["ip", "link", "set", veth, "up"])


def namespace_pids(namespace: str) -> list[int]:
    out = run_tool(["ip", "netns", "pids", namespace], check=False).stdout
    return [int(p) for p in out.split() if p.isdigit()]


def kill_pids(pids: list[int], timeout_s: float = 5.0) -> list[int]:
    """SIGKILL `pids` and wait until they are gone; returns those still alive after `timeout_s`."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + timeout_s
    alive = list(pids)
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if _alive(p)]
        if alive:
            time.sleep(0.05)
    return alive


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie is dead, awaiting its parent
    except (OSError, IndexError):  # gone: before the open (ENOENT) or between open and read (ESRCH)
        return False


def delete_namespace(namespace: str) -> None:
    """Kill every process in it, then delete it (its veth pair goes with it)."""
    for _ in range(3):  # a process may fork while we kill; go round until none is left
        pids = namespace_pids(namespace)
        if not pids:
            break
        kill_pids(pids)
    run_tool(["ip", "netns", "delete", namespace], check=False)


def delete_link(name: str) -> None:
    run_tool(["ip", "link", "delete", name], check=False)


def set_link(namespace: str, up: bool) -> None:
    """Take a node's link down (or up again): the way tests emulate a node dropping off the net."""
    run_tool(["ip", "-n", namespace, "link", "set", "eth0", "up" if up else "down"])
