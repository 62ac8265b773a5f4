"""The sandbox's per-pair rates on paper: --regions, --links files, the matrix and its checks
(no sandbox is built; test_sandbox_regions.py measures the shaped links)."""

from __future__ import annotations

import pytest

from vpscluster.cluster.sandbox import links
from vpscluster.cluster.sandbox.state import SandboxInfo, SandboxNode
from vpscluster.errors import UserError


def info_of(ports: list[float], regions: list[str | None]) -> SandboxInfo:
    nodes = [SandboxNode(name=f"node-{i + 1}", address=f"10.0.0.{i + 2}", namespace=f"ns{i}", bandwidth_mbit=p,
                         cpu=None, veth=f"v{i}", workdir="/tmp", region=r)
             for i, (p, r) in enumerate(zip(ports, regions))]
    return SandboxInfo(name="t", cluster_file="", nodes=nodes, subnet="", bridge="", gateway="", state_dir="")


def test_parse_regions():
    assert links.parse_regions("fra:2,lax:3") == [("fra", 2), ("lax", 3)]
    for bad in ("fra", "fra:0", "Fra:2", "fra:2,fra:1", "fra:x"):
        with pytest.raises(UserError, match="--regions"):
            links.parse_regions(bad)


def test_region_matrix_and_port_cap():
    info = info_of([200, 200, 100, 200], ["fra", "fra", "lax", "lax"])
    info.links = links.region_links(info.nodes, 30.0)
    rates = {(l["src"], l["dst"]): l["bandwidth_mbit"] for l in links.matrix(info)}
    assert rates[("node-1", "node-2")] == 200 and rates[("node-3", "node-4")] == 100  # the slower port
    assert rates[("node-1", "node-3")] == rates[("node-4", "node-2")] == 30
    assert links.destinations(info, "node-1") == {"10.0.0.4": 30.0, "10.0.0.5": 30.0}
    assert links.destinations(info, "node-2") == {"10.0.0.4": 30.0, "10.0.0.5": 30.0}
    links.check_ports(info)
    info.links = links.region_links(info.nodes, 150.0)
    with pytest.raises(UserError, match="faster than node-3's --bandwidth"):
        links.check_ports(info)


def test_links_file(tmp_path):
    names = ["node-1", "node-2", "node-3"]
    f = tmp_path / "links.csv"
    f.write_text("# src,dst,rate\nnode-1,node-2,50mbit\n\nnode-2,node-3,10mbit  # slow one way\nnode-3,node-2,20mbit\n")
    got = {(l["src"], l["dst"]): l["bandwidth_mbit"] for l in links.read_links_file(f, names)}
    assert got == {("node-1", "node-2"): 50, ("node-2", "node-1"): 50, ("node-2", "node-3"): 10, ("node-3", "node-2"): 20}
    for text, message in [("node-1,node-9,1mbit", "no node 'node-9'"), ("node-1,node-1,1mbit", "not a link"),
                          ("node-1,node-2", "not src,dst,rate"), ("node-1,node-2,1mbit\nnode-1,node-2,2mbit", "twice")]:
        f.write_text(text)
        with pytest.raises(UserError, match=message):
            links.read_links_file(f, names)
    with pytest.raises(UserError, match="cannot read"):
        links.read_links_file(tmp_path / "missing.csv", names)
    # A file's pair replaces the regions' rate for that pair only.
    merged = links.merge([{"src": "node-1", "dst": "node-3", "bandwidth_mbit": 30.0},
                          {"src": "node-1", "dst": "node-2", "bandwidth_mbit": 30.0}],
                         [{"src": "node-1", "dst": "node-2", "bandwidth_mbit": 5.0}])
    assert {(l["src"], l["dst"]): l["bandwidth_mbit"] for l in merged} == {("node-1", "node-2"): 5.0, ("node-1", "node-3"): 30.0}


def test_up_refuses_inconsistent_options():
    from sandbox_fixtures import TEST_PREFIX
    from vpscluster.cluster import sandbox

    name = f"{TEST_PREFIX}never"  # refused before anything is built
    with pytest.raises(UserError, match="--regions gives 4 nodes"):
        sandbox.up(name, nodes=3, regions="fra:2,lax:2")
    with pytest.raises(UserError, match="needs --regions"):
        sandbox.up(name, nodes=2, region_bandwidth="30mbit")
    with pytest.raises(UserError, match="--latency cannot be combined"):
        sandbox.up(name, regions="fra:1,lax:1", latency_ms=50)
