"""Pre-flight: before anything starts, every node must be reachable, usable and alike.

Cheap checks that fail in seconds, naming the node, instead of a rendezvous time-out ten
minutes later: SSH reaches every node and its work directory exists (resolved to an absolute
path there, so nothing later depends on `~` or on the launcher's paths); a fresh probe (a quick
one is run when none is fresh) shows no blocking problem (PyTorch missing, versions differing);
the interface carrying each node's address (an overlay's interface must carry the node's
overlay address); on every node reached over a public address, provision's firewall loaded
(cluster/netsafety.py); a free rendezvous port on the head.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from vpscluster import nodeside
from vpscluster.errors import RemoteError, UserError
from vpscluster.launch.commands import shell_path
from vpscluster.launch.netif import find_interface

PROBE_MAX_AGE_S = 3600.0


@dataclass
class NodeState:
    """What pre-flight learned about one node."""

    name: str
    address: str
    workdir: str  # absolute, on the node
    interface: str | None = None
    gpus: int = 0
    cuda: bool = False
    facts: dict[str, Any] = field(default_factory=dict)


async def resolve_workdirs(executors, timeout_s: float) -> dict[str, str]:
    """Create each node's workdir and return its absolute path; one error naming every bad node."""

    async def one(ex):
        cmd = f"mkdir -p {shell_path(ex.node.workdir)} && cd {shell_path(ex.node.workdir)} && pwd -P"
        try:
            return ex, await asyncio.wait_for(ex.run(cmd, timeout_s=timeout_s), timeout_s + 5)
        except asyncio.TimeoutError:
            return ex, None

    results = await asyncio.gather(*(one(ex) for ex in executors))
    bad = []
    out = {}
    for ex, r in results:
        if r is None or not r.ok or not r.stdout.strip():
            why = "no answer within %.0f s" % timeout_s if r is None else r.reason()
            why = why[len(ex.node.name) + 2:] if why.startswith(f"{ex.node.name}: ") else why
            bad.append(f"node {ex.node.name} ({ex.node.host}): {why}")
        else:
            out[ex.node.name] = r.stdout.strip().splitlines()[-1]
    if bad:
        raise RemoteError("cannot reach or use " + "; ".join(bad) + " — fix it or remove the node from the cluster file")
    return out


async def probe_facts(cluster, executors, force: bool, say=None, any_age: bool = False) -> dict[str, dict]:
    """Per-node facts from a fresh probe (a quick probe when none is fresh; `any_age`: the last
    probe however old, for a relaunch of a run its first launch checked); refuses on blocking problems."""
    from vpscluster.probe.api import ProbeSettings, blocking_problems, run_probe_async
    from vpscluster.probe.store import load_probe

    probe = load_probe(cluster, None if any_age else PROBE_MAX_AGE_S)
    if probe is not None and blocking_problems(probe):
        probe = None  # the user may have fixed it since: look again rather than refuse on old news
    if probe is None:
        if say is not None:
            say("no fresh clean probe of this cluster: running a quick one (saved for the next hour)")
        probe = await run_probe_async(cluster, ProbeSettings.make(quick=True), quick=True,
                                      executors={ex.node.name: ex for ex in executors})
    problems = blocking_problems(probe)
    if problems and not force:
        first = problems[0]
        message = str(first.get("message", "")).strip()
        nodes = first.get("nodes") or []
        # Name the nodes once (the probe's message often starts with the node already).
        while any(message.startswith(f"{n}: ") for n in nodes):
            message = message.split(": ", 1)[1]
        where = ", ".join(nodes) or "cluster"
        more = f" (and {len(problems) - 1} more problems)" if len(problems) > 1 else ""
        fix = first.get("fix") or "fix it"
        raise UserError(f"pre-flight: {where}: {message}{more}; {fix}, or pass --force to start anyway")
    return {n["name"]: n for n in probe.get("nodes", [])}


def resolve_address(host: str) -> str:
    """An IP literal as is; a DNS name resolved once, here, so no node ever resolves a name."""
    import ipaddress
    import socket

    try:
        ipaddress.ip_address(host)
        return host
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError as e:
        raise UserError(f"cannot resolve node address {host!r}: {e.strerror}; put its IP address in the cluster file") from None
    v4 = [i[4][0] for i in infos if i[0] == socket.AF_INET]
    return (v4 or [infos[0][4][0]])[0]


async def free_port(executor, address: str, timeout_s: float) -> int:
    r = await executor.run(nodeside.command(executor.node.python, "free_port", address), timeout_s=timeout_s)
    if not r.ok:
        raise RemoteError(f"node {executor.node.name}: could not find a free rendezvous port: {r.reason()}")
    return int(r.stdout.strip().splitlines()[-1])


@dataclass(frozen=True)
class Endpoint:
    """Where a node's cluster traffic goes: the address it binds to and advertises, its interface."""

    address: str
    interface: str | None  # None: unknown until asked on the node
    via: str  # "overlay" (the provisioned WireGuard mesh) or "underlay" (the cluster file's host)


def node_endpoints(cluster, facts: dict[str, dict] | None = None, resolve: bool = True) -> dict[str, Endpoint]:
    """The one place deciding the addresses of train, run and batch: each node's overlay address
    and interface when `vpscluster provision` made an overlay for these nodes (cluster/overlay.py),
    else the cluster file's host (resolved here unless `resolve` is False) and the interface the
    probe found for it."""
    from vpscluster.cluster import overlay

    mesh = None if cluster.is_local else overlay.load(cluster)
    out = {}
    for node in cluster.nodes:
        if mesh is not None:
            out[node.name] = Endpoint(mesh.addresses[node.name], mesh.interface, "overlay")
        else:
            f = (facts or {}).get(node.name, {})
            out[node.name] = Endpoint(resolve_address(node.host) if resolve else node.host, f.get("interface"), "underlay")
    return out


async def check_endpoint(ex, endpoint: Endpoint, head_address: str, timeout_s: float, source: str | None = None) -> str:
    """The interface carrying the node's traffic: an overlay's interface must hold the node's
    overlay address (else RemoteError with the fix); an unknown underlay one is looked up."""
    if endpoint.via != "overlay":
        if endpoint.interface:
            return endpoint.interface
        return (await find_interface(ex, endpoint.address, head_address, timeout_s)).name
    from vpscluster.launch.netif import interface_for_address

    r = await ex.run("ip -o addr", timeout_s=timeout_s)
    if not r.ok:
        raise RemoteError(f"node {ex.node.name}: could not list its network interfaces with `ip -o addr`: {r.reason()}")
    if interface_for_address(r.stdout, endpoint.address) != endpoint.interface:
        where = f" --cluster {source}" if source else ""
        raise RemoteError(f"node {ex.node.name}: the overlay is not up there ({endpoint.interface} does not carry "
                          f"{endpoint.address}); bring it back with `vpscluster provision{where} --only overlay,firewall`")
    return endpoint.interface


async def preflight(cluster, executors, facts: dict[str, dict], timeout_s: float) -> dict[str, NodeState]:
    """Workdirs, interfaces and accelerators of every node (facts from the probe where it has them);
    addresses and interfaces from `node_endpoints` (the overlay's, once provisioned)."""
    from vpscluster.cluster.netsafety import require_firewall

    workdirs = await resolve_workdirs(executors, timeout_s)
    await require_firewall(cluster, executors, timeout_s)  # public nodes: the firewall must be up
    endpoints = node_endpoints(cluster, facts)
    head_address = endpoints[cluster.head].address

    async def one(ex) -> NodeState:
        node = ex.node
        f = facts.get(node.name, {})
        gpus = f.get("gpus") or []
        end = endpoints[node.name]
        state = NodeState(
            node.name, end.address, workdirs[node.name], interface=end.interface,
            gpus=len(gpus) if isinstance(gpus, list) else int(gpus or 0),
            cuda=bool(f.get("cuda_available")), facts=f,
        )
        state.interface = await check_endpoint(ex, end, head_address, timeout_s, cluster.source)
        return state

    states = await asyncio.gather(*(one(ex) for ex in executors))
    return {s.name: s for s in states}
