"""The sandbox: an emulated WAN cluster on one Linux machine (root), built from kernel parts.

    up(name, nodes, bandwidth, cpu, latency_ms) -> SandboxInfo   network namespaces on a bridge,
        tc-shaped links, cgroup CPU quotas, an sshd per node, a cluster.yaml to use it with
    down(name) / down_prefix(p) / down_all()                    remove all of it (idempotent)
    status(name=None)                                           what exists, and whether sshd lives
    set_link(name, node, up) / set_rate(name, node, rate)       faults: a link down, a slower link
    set_pair_rate(name, node, peer, rate)                       a slower link between two nodes

Every node is a network namespace on this machine with its own sshd; the filesystem is shared,
but commands reach the nodes through SSH exactly as on rented VPS nodes. The pieces live in
netns.py (plumbing), shaping.py (tc), cgroup.py (CPU), sshd.py (servers, keys), checks.py
(does it work), clusterfile.py and state.py (names and records). An `up` that fails half-way removes what it built before it re-raises.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Callable, Sequence

from vpscluster.cluster.sandbox import cgroup, checks, links, netns, rootfs, shaping, sshd, state
from vpscluster.cluster.sandbox.checks import ssh_command
from vpscluster.cluster.sandbox.clusterfile import write_cluster_file
from vpscluster.cluster.sandbox.workdir import mount_workdir, unmount_below
from vpscluster.cluster.sandbox.state import SandboxInfo, SandboxNode
from vpscluster.cluster.sandbox.system import require_root, require_sandbox_support
from vpscluster.errors import UserError
from vpscluster.units import parse_list, parse_rate_mbit

__all__ = ["SandboxInfo", "SandboxNode", "up", "down", "down_all", "down_prefix", "status", "info", "set_link", "set_rate", "set_pair_rate", "ssh_command", "DEFAULT_NAME"]

DEFAULT_NAME = "default"
Progress = Callable[[str], None]


def _parse_cpu(text: str, what: str) -> float | None:
    if str(text).strip().lower() in ("none", "unlimited", "-"):
        return None
    try:
        share = float(text)
    except ValueError:
        raise UserError(f"{what}: {text!r} is not a CPU share; write a fraction of one core, e.g. 0.45 or 1.5") from None
    ncpu = os.cpu_count() or 1
    if not 0.05 <= share <= ncpu:  # the kernel allows no quota under 1 ms per 20 ms period
        raise UserError(f"{what}: {share:g} is outside 0.05-{ncpu} (a fraction of one core, at most this machine's {ncpu} cores)")
    return share


def _per_node(value, parse, what: str, count: int) -> list:
    if value is None:
        return [None] * count
    if isinstance(value, (list, tuple)):
        value = ",".join(str(v) for v in value)
    return parse_list(str(value), parse, what, count)


def up(
    name: str = DEFAULT_NAME,
    nodes: int | None = None,
    bandwidth: str | float | Sequence = "1gbit",
    cpu: str | float | Sequence | None = None,
    latency_ms: float | None = None,
    progress: Progress | None = None,
    own_root: bool = False,
    regions: str | Sequence[tuple[str, int]] | None = None,
    region_bandwidth: str | float | None = None,
    links_file: str | None = None,
) -> SandboxInfo:
    """Build sandbox `name`; raise UserError (and leave nothing behind) when it cannot.

    `regions` ("fra:2,lax:2") names the nodes' regions in order (and so their number);
    `region_bandwidth` is the rate of every pair across two regions, `bandwidth` the port (the
    rate inside a region); `links_file` gives rates per pair (links.py), over the regions'.
    """
    say = progress or (lambda _msg: None)
    state.check_name(name)
    spans = links.parse_regions(regions) if isinstance(regions, str) else list(regions or [])
    if spans:
        total = sum(count for _, count in spans)
        if nodes is not None and nodes != total:
            raise UserError(f"sandbox: --nodes {nodes} but --regions gives {total} nodes; drop --nodes or make them agree")
        nodes = total
    elif region_bandwidth is not None:
        raise UserError("sandbox: --region-bandwidth needs --regions (e.g. --regions fra:2,lax:2 --region-bandwidth 30mbit)")
    nodes = 3 if nodes is None else nodes
    between = parse_rate_mbit(region_bandwidth, "--region-bandwidth") if region_bandwidth is not None else None
    if latency_ms and (spans or links_file):
        raise UserError("sandbox: --latency cannot be combined with --regions or --links (per-pair delay is not "
                        "emulated); drop --latency")
    if not isinstance(nodes, int) or not 1 <= nodes <= state.MAX_NODES:
        raise UserError(f"sandbox: --nodes {nodes} is outside 1-{state.MAX_NODES}")
    rates = _per_node(bandwidth, parse_rate_mbit, "--bandwidth", nodes)
    shares = _per_node(cpu, _parse_cpu, "--cpu", nodes)
    if latency_ms is not None and latency_ms < 0:
        raise UserError(f"--latency: {latency_ms:g} must be >= 0 ms")
    require_sandbox_support()
    if own_root and (why := rootfs.supported()):
        raise UserError(why)
    if latency_ms and not shaping.netem_available():
        raise UserError("--latency needs the kernel's netem qdisc (sch_netem), which this kernel does not have; "
                        "run without --latency, or on a kernel with netem (modprobe sch_netem)")
    hierarchy = cgroup.require()

    # The lock covers only the reservation (name, subnet, record, cgroups), so sandboxes being
    # built or removed side by side do not wait for each other's sshd start-up and checks.
    with state.sandbox_lock():
        _refuse_existing(name)
        octet = state.choose_subnet_octet(name)
        root = state.state_dir(name)
        prefix = f"{state.SUBNET_PREFIX}.{octet}"
        info = SandboxInfo(
            name=name, cluster_file=str(root / "cluster.yaml"), nodes=[], subnet=f"{prefix}.0/24",
            bridge=state.bridge_name(name), gateway=f"{prefix}.1", state_dir=str(root), latency_ms=latency_ms,
            identity_file=str(root / "id_ed25519"), known_hosts=str(root / "known_hosts"), cgroup=hierarchy.version,
        )
        info.own_root = own_root
        for i in range(nodes):
            node = state.node_name(i + 1)
            info.nodes.append(SandboxNode(
                name=node, address=f"{prefix}.{i + 2}", namespace=state.netns_name(name, node),
                bandwidth_mbit=rates[i], cpu=shares[i], veth=state.veth_name(name, i + 1),
                workdir=str(root / "nodes" / node / "work"), cgroup=str(hierarchy.parent / name / node),
                region=[r for r, count in spans for _ in range(count)][i] if spans else None,
            ))
        if between is not None:
            info.links = links.region_links(info.nodes, between)
        if links_file:
            info.links = links.merge(info.links, links.read_links_file(links_file, [n.name for n in info.nodes]))
        links.check_ports(info)
        try:
            root.mkdir(parents=True, mode=0o700)
            state.save_info(info)  # first, so a later `up` sees the subnet taken and `down` the record
            for n in info.nodes:
                hierarchy.create(info.name, n.name, n.cpu, sandbox_nodes=len(info.nodes))
        except BaseException:
            _teardown(name)
            raise
    try:
        _build(info, say)
    except BaseException:
        say("failed; removing what was built")
        _teardown(name)
        raise
    return info


def _refuse_existing(name: str) -> None:
    cg = cgroup.sandbox_cgroup(name)
    leftovers = (state.state_dir(name).exists() or netns.list_namespaces(f"{state.NETNS_PREFIX}{name}.")
                 or (cg is not None and cg.exists()))
    if leftovers:
        raise UserError(f"sandbox {name!r} already exists; remove it first with `vpscluster sandbox down --name {name}`")
    if netns.list_links(state.bridge_name(name)):
        raise UserError(f"sandbox: bridge {state.bridge_name(name)} already exists (another sandbox's name hashes alike); choose another --name")


def _build(info: SandboxInfo, say: Progress) -> None:
    root = Path(info.state_dir)
    say("keys")
    client_pub = sshd.generate_key(Path(info.identity_file), f"vpscluster-sandbox-{info.name}")
    authorized_keys = root / "authorized_keys"
    authorized_keys.write_text(client_pub + "\n")
    authorized_keys.chmod(0o600)

    say(f"bridge {info.bridge} {info.subnet}")
    netns.create_bridge(info.bridge, f"{info.gateway}/24")
    hosts = {n.name: n.address for n in info.nodes}
    known_hosts = []
    for index, n in enumerate(info.nodes, start=1):
        say(f"{n.name}: namespace, {n.bandwidth_mbit:g} Mbit/s, cpu {n.cpu if n.cpu is not None else 'unlimited'}")
        node_dir = root / "nodes" / n.name
        Path(n.workdir).mkdir(parents=True, exist_ok=True)
        mount_workdir(n.workdir)
        cg = Path(n.cgroup)
        netns.create_node(n.namespace, n.veth, state.peer_name(info.name, index), info.bridge, f"{n.address}/24")
        links.shape(info, n)
        sshd.write_etc_hosts(n.namespace, n.name, {n.name: n.address, **hosts})
        host_key = node_dir / "ssh_host_ed25519_key"
        host_pub = sshd.generate_key(host_key, f"{n.name}.{info.name}")
        known_hosts.append(f"{n.address} {' '.join(host_pub.split()[:2])}")
        config = sshd.write_config(node_dir, n.address, host_key, authorized_keys)
        if info.own_root:  # its own filesystem: an overlay of the host's / (rootfs.py)
            rootfs.start(n.namespace, n.name, config, node_dir / "sshd.log", cg, node_dir)
        else:
            sshd.start(n.namespace, n.name, config, node_dir / "sshd.log", cg)
    Path(info.known_hosts).write_text("\n".join(known_hosts) + "\n")
    write_cluster_file(info)
    say("checking ssh to every node and node-to-node links")
    for n in info.nodes:
        sshd.wait_listening(n.address)
    checks.check_ssh(info)
    checks.check_node_to_node(info)
    state.save_info(info)


def down(name: str = DEFAULT_NAME) -> bool:
    """Remove sandbox `name` entirely; False when there was nothing to remove. Safe to repeat."""
    state.check_name(name)
    require_root()
    found = _teardown(name)
    with state.sandbox_lock():  # not while another `up` is creating its cgroups under it
        cgroup.remove_parent_if_empty()
    return found


def _teardown(name: str) -> bool:
    found = False
    for ns in netns.list_namespaces(f"{state.NETNS_PREFIX}{name}."):
        netns.delete_namespace(ns)  # kills its processes (sshd and all it started) first
        sshd.remove_etc_hosts(ns)
        found = True
    for d in Path("/etc/netns").glob(f"{state.NETNS_PREFIX}{name}.*"):
        shutil.rmtree(d, ignore_errors=True)
        found = True
    cg = cgroup.sandbox_cgroup(name)
    if cg is not None and cg.exists():
        cgroup.remove_tree(cg)  # kills what escaped the namespace but not the cgroup
        found = True
    links = [state.bridge_name(name), f"{state.VETH_PREFIX}{state.tag(name)}n", f"{state.PEER_PREFIX}{state.tag(name)}n"]
    for link in [found_link for prefix in links for found_link in netns.list_links(prefix)]:
        netns.delete_link(link)
        found = True
    root = state.state_dir(name)
    if unmount_below(root):
        found = True
    if root.exists():
        shutil.rmtree(root)
        found = True
    return found


def down_all() -> list[str]:
    """Remove every vpscluster sandbox on this machine, recorded or half-built; their names."""
    import re

    require_root()
    with state.sandbox_lock():
        removed = sorted(n for n in _every_name() if _teardown(n))
        parent = cgroup.parent()
        # Links whose sandbox name is lost (state dir gone): recognisable by their shape alone.
        shapes = re.compile(rf"{state.BRIDGE_PREFIX}[0-9a-f]{{6}}|({state.VETH_PREFIX}|{state.PEER_PREFIX})[0-9a-f]{{6}}n\d+")
        for link in netns.list_links(""):
            if shapes.fullmatch(link):
                netns.delete_link(link)
        if parent is not None and parent.is_dir():
            cgroup.remove_tree(parent)  # and what is left below it
    return removed


def _every_name() -> set[str]:
    """Names of every sandbox with a trace here: a record, a namespace or a cgroup."""
    names = set(state.known_names())
    for ns in netns.list_namespaces(state.NETNS_PREFIX):
        names.add(ns[len(state.NETNS_PREFIX):].split(".", 1)[0])
    parent = cgroup.parent()
    if parent is not None and parent.is_dir():
        names.update(p.name for p in parent.iterdir() if p.is_dir())
    return names


def down_prefix(prefix: str) -> list[str]:
    """Remove every sandbox whose name starts with `prefix` (recorded or half-built); their names.

    What tests and CI use to clean up after themselves without touching anyone else's sandbox.
    """
    if not prefix or not state.NAME_RE.fullmatch(prefix):
        raise UserError(f"sandbox down --prefix: {prefix!r} is not a name prefix; give the start of the names to remove "
                        "(1-24 lower-case letters, digits or '-', e.g. pt-), or --all to remove every sandbox")
    require_root()
    with state.sandbox_lock():
        removed = sorted(n for n in _every_name() if n.startswith(prefix) and _teardown(n))
        cgroup.remove_parent_if_empty()
    return removed


def status(name: str | None = None) -> list[dict]:
    """One record per sandbox (all when `name` is None): its nodes and whether each is alive.

    `state` is "up" (every namespace and sshd there), "degraded" (some missing) or "partial"
    (pieces without a complete record: a half-finished up; `down` removes them).
    """
    require_root()
    if name:
        names = [state.check_name(name)]
    else:
        names = set(state.known_names())
        names.update(ns[len(state.NETNS_PREFIX):].split(".", 1)[0] for ns in netns.list_namespaces(state.NETNS_PREFIX))
        names = sorted(names)
    return [rec for rec in (_status_of(sb) for sb in names) if rec is not None]


def _status_of(name: str) -> dict | None:
    info = state.load_info(name)
    if info is None:
        spaces = netns.list_namespaces(f"{state.NETNS_PREFIX}{name}.")
        if not (spaces or state.state_dir(name).exists()):
            return None
        return {"name": name, "state": "partial", "cluster_file": None, "cgroup": None,
                "nodes": [{"name": ns.rsplit(".", 1)[1], "namespace": ns, "namespace_exists": True} for ns in spaces]}
    nodes = []
    for n in info.nodes:
        try:
            pid = int((Path(info.state_dir) / "nodes" / n.name / "sshd.pid").read_text().strip())
        except (FileNotFoundError, ValueError):
            pid = None
        nodes.append({"name": n.name, "address": n.address, "namespace": n.namespace,
                      "bandwidth_mbit": n.bandwidth_mbit, "cpu": n.cpu, "region": n.region,
                      "namespace_exists": Path(netns.NETNS_DIR, n.namespace).exists(),
                      "sshd_pid": pid, "sshd_alive": sshd.alive(pid)})
    healthy = all(x["namespace_exists"] and x["sshd_alive"] for x in nodes)
    return {"name": name, "state": "up" if healthy else "degraded", "cluster_file": info.cluster_file,
            "subnet": info.subnet, "latency_ms": info.latency_ms, "cgroup": info.cgroup or None, "nodes": nodes,
            "links": links.matrix(info)}


def set_link(name: str, node: str, up: bool) -> None:
    """Take a sandbox node's link down or up (fault injection for tests and benchmarks)."""
    netns.set_link(_node_of(name, node).namespace, up)


def set_rate(name: str, node: str, bandwidth: str | float) -> float:
    """Change a node's shaped rate while it runs (a link that degrades); returns the new Mbit/s.
    `bandwidth`: a rate as tc writes it (`20mbit`), or a number of bits per second.

    The cluster file keeps its advertised_bandwidth: as with a real provider, what a node is
    advertised at and what it delivers can differ, and the probe is there to notice.
    """
    n = _node_of(name, node)
    rate_mbit = parse_rate_mbit(bandwidth, "bandwidth")
    links.shape(state.load_info(name), n, port_mbit=rate_mbit)
    with state.sandbox_lock():
        info = state.load_info(name)
        info.node(node).bandwidth_mbit = rate_mbit
        state.save_info(info)
    return rate_mbit


def set_pair_rate(name: str, node: str, peer: str, bandwidth: str | float) -> float:
    """Change the rate between `node` and `peer`, both directions, while they run (a long-distance
    link that degrades); returns the new Mbit/s. Each end still caps it at its port."""
    n, p = _node_of(name, node), _node_of(name, peer)
    if n.name == p.name:
        raise UserError(f"sandbox set: --peer {peer} is the node itself; give another node")
    rate_mbit = parse_rate_mbit(bandwidth, "bandwidth")
    with state.sandbox_lock():
        info = state.load_info(name)
        info.links = links.merge(info.links, [{"src": a, "dst": b, "bandwidth_mbit": rate_mbit}
                                              for a, b in ((n.name, p.name), (p.name, n.name))])
        state.save_info(info)
    for x in (n.name, p.name):
        links.shape(info, info.node(x))
    return rate_mbit


def set_cpu(name: str, node: str, cpu: str | float | None) -> float | None:
    """Change a node's CPU share while it runs (a noisy neighbour, a throttled machine); returns
    the new share (None = unlimited). Processes keep running; the quota holds from the next
    20 ms period. The record (and `status`) follow; the cluster file is left as it was."""
    n = _node_of(name, node)
    share = _parse_cpu(str(cpu), "--cpu")
    if not n.cgroup:
        raise UserError(f"sandbox {name!r} node {node!r} has no cgroup; recreate the sandbox")
    cgroup.set_quota(Path(n.cgroup), share)
    with state.sandbox_lock():
        info = state.load_info(name)
        info.node(node).cpu = share
        state.save_info(info)
    return share


def _node_of(name: str, node: str) -> SandboxNode:
    require_root()
    info = state.load_info(state.check_name(name))
    if info is None:
        raise UserError(f"sandbox {name!r} does not exist; bring it up with `vpscluster sandbox up --name {name}`")
    try:
        return info.node(node)
    except KeyError:
        raise UserError(f"sandbox {name!r} has no node {node!r}; nodes: {', '.join(n.name for n in info.nodes)}") from None


def info(name: str = DEFAULT_NAME) -> SandboxInfo | None:
    """The record of a sandbox that is up (None when there is none)."""
    return state.load_info(state.check_name(name))
