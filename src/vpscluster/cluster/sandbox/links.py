"""Per-pair link rates of a sandbox: regions, a link matrix, and shaping per destination.

    parse_regions("fra:2,lax:2") -> [("fra", 2), ("lax", 2)]
    region_links(nodes, between_mbit) -> overrides   every pair across two regions at `between_mbit`
    read_links_file(path, names) -> overrides        lines `src,dst,rate` (both directions unless
                                                     the reverse pair has its own line)
    matrix(info) -> [{"src", "dst", "bandwidth_mbit"}]   what every ordered pair runs at
    shape(info, node, port_mbit=None)                (re)apply one node's shaping

A node's `bandwidth_mbit` is its port (the rate inside its region, and to this machine); an
override is the rate of one ordered pair. A pair never runs faster than either end's port:
A -> B runs at min(port A, port B, override A -> B).

How (shaping.py has the token-bucket tuning): a node without overrides keeps one tbf per
direction. A node with overrides gets an htb on its eth0 egress instead: a root class at its
port, a default class (everything else, at the port), and one class per distinct pair rate,
chosen by a u32 filter on the destination address; each leaf queues 50 ms of its rate. The
children's guaranteed rates add up to the port, so the port still caps the sum. The ingress side
(a tbf at the port on the bridge-side veth) stays as it is.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING

from vpscluster.errors import UserError
from vpscluster.units import parse_rate_mbit

if TYPE_CHECKING:
    from vpscluster.cluster.sandbox.state import SandboxInfo, SandboxNode

REGION_RE = re.compile(r"[a-z][a-z0-9-]{0,23}")


def parse_regions(spec: str) -> list[tuple[str, int]]:
    """`fra:2,lax:2` -> [("fra", 2), ("lax", 2)]: region names in order, nodes in each."""
    out: list[tuple[str, int]] = []
    for part in str(spec).split(","):
        name, sep, count = part.strip().partition(":")
        if not sep or not REGION_RE.fullmatch(name) or not count.strip().isdigit() or int(count) < 1:
            raise UserError(f"--regions: {part.strip()!r} is not REGION:NODES; write e.g. fra:2,lax:2 "
                            "(a lower-case name, then how many nodes it has)")
        if name in (n for n, _ in out):
            raise UserError(f"--regions: region {name!r} is given twice; give each region once with its node count")
        out.append((name, int(count)))
    return out


def region_links(nodes: list["SandboxNode"], between_mbit: float) -> list[dict]:
    """An override at `between_mbit` for every ordered pair of nodes in different regions."""
    return [{"src": a.name, "dst": b.name, "bandwidth_mbit": between_mbit}
            for a in nodes for b in nodes if a is not b and a.region != b.region]


def read_links_file(path: str | Path, names: list[str]) -> list[dict]:
    """A link matrix file: one `src,dst,rate` a line (`#` comments, blank lines allowed). A line
    sets both directions unless the reverse pair has a line of its own."""
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise UserError(f"--links: cannot read {path}: {e.strerror or e}; give a file of src,dst,rate lines") from None
    given: dict[tuple[str, str], float] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        cells = [c.strip() for c in line.split(",")]
        where = f"--links {path} line {number}"
        if len(cells) != 3:
            raise UserError(f"{where}: {raw.strip()!r} is not src,dst,rate; write e.g. node-1,node-3,30mbit")
        src, dst, rate = cells
        for node in (src, dst):
            if node not in names:
                raise UserError(f"{where}: no node {node!r}; the nodes are {', '.join(names)}")
        if src == dst:
            raise UserError(f"{where}: {src} -> {src} is not a link; give two different nodes")
        if (src, dst) in given:
            raise UserError(f"{where}: {src},{dst} is given twice; keep one line per pair")
        given[(src, dst)] = parse_rate_mbit(rate, where)
    both = dict(given)
    for (src, dst), mbit in given.items():
        both.setdefault((dst, src), mbit)
    return [{"src": s, "dst": d, "bandwidth_mbit": m} for (s, d), m in sorted(both.items())]


def merge(base: list[dict], extra: list[dict]) -> list[dict]:
    """Overrides of `base` replaced by those of `extra` for the same ordered pair."""
    out = {(l["src"], l["dst"]): l for l in base}
    out.update({(l["src"], l["dst"]): l for l in extra})
    return [out[k] for k in sorted(out)]


def check_ports(info: "SandboxInfo") -> None:
    """Refuse a pair rate above the port of either end: it could never be reached."""
    ports = {n.name: n.bandwidth_mbit for n in info.nodes}
    for l in info.links:
        slower = min(l["src"], l["dst"], key=lambda x: ports[x])
        if l["bandwidth_mbit"] > ports[slower]:
            raise UserError(f"sandbox: link {l['src']} -> {l['dst']} at {l['bandwidth_mbit']:g} Mbit/s is faster than "
                            f"{slower}'s --bandwidth {ports[slower]:g} Mbit/s; raise --bandwidth or lower the link")


def pair_rate(info: "SandboxInfo", src: str, dst: str) -> float:
    ports = {n.name: n.bandwidth_mbit for n in info.nodes}
    rate = min(ports[src], ports[dst])
    for l in info.links:
        if l["src"] == src and l["dst"] == dst:
            rate = min(rate, l["bandwidth_mbit"])
    return rate


def matrix(info: "SandboxInfo") -> list[dict]:
    """Every ordered pair and the rate it is shaped to (Mbit/s)."""
    return [{"src": a.name, "dst": b.name, "bandwidth_mbit": pair_rate(info, a.name, b.name)}
            for a in info.nodes for b in info.nodes if a is not b]


def destinations(info: "SandboxInfo", node: str) -> dict[str, float]:
    """{destination address: pair rate} for `node`'s overrides (what its egress classes shape)."""
    addresses = {n.name: n.address for n in info.nodes}
    return {addresses[l["dst"]]: l["bandwidth_mbit"] for l in info.links if l["src"] == node}


def shape(info: "SandboxInfo", node: "SandboxNode", port_mbit: float | None = None) -> None:
    """(Re)apply `node`'s shaping: its port (`port_mbit`, default its recorded rate) both ways,
    and its per-destination rates on egress where it has any."""
    from vpscluster.cluster.sandbox import shaping

    port = node.bandwidth_mbit if port_mbit is None else port_mbit
    pairs = destinations(info, node.name)
    if not pairs:
        shaping.shape_node(node.namespace, node.veth, port, info.latency_ms)
        return
    shaping.shape_pairs("eth0", port, pairs, namespace=node.namespace)
    shaping.shape(node.veth, port)
