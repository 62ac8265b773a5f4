"""The whole probe on local nodes (several "nodes" on loopback addresses, no SSH): JSON shape,
link matrix, a real gloo all-reduce sweep, problems for a node without torch, the store, the CLI."""

import asyncio
import dataclasses
import json
import os
import stat
import sys
import time

import pytest

from vpscluster.cluster.node import Cluster, Node
from vpscluster.probe.api import ProbeSettings, run_probe_async
from vpscluster.probe.collectives import SweepSettings
from vpscluster.probe.problems import blocking_problems
from vpscluster.probe.store import load_probe, probe_path, save_probe

CONTRACT_NODE_KEYS = {"name", "cpu_count", "memory_bytes", "gpus", "disk_read_mb_s", "python", "torch", "cuda", "flops"}
CONTRACT_LINK_KEYS = {"src", "dst", "bandwidth_mbit", "rtt_ms"}


def local_nodes(tmp_path, n, pythons=None):
    pythons = pythons or {}
    return tuple(Node(name=f"n{i}", host=f"127.0.0.{i + 1}", local=True, python=pythons.get(i, sys.executable),
                      workdir=str(tmp_path / f"work{i}"), advertised_bandwidth_mbit=1000.0) for i in range(n))


def probe_local(cluster, settings):
    from vpscluster.cluster.inventory import open_executors

    async def go():
        async with open_executors(cluster) as exs:
            return await run_probe_async(cluster, settings, quick=True, save=False,
                                         executors={e.node.name: e for e in exs})

    return asyncio.run(go())


@pytest.mark.slow
def test_two_local_nodes_links_and_allreduce_sweep(tmp_path):
    # Two nodes keep it cheap; the 3- and 4-node runs are in test_probe_sandbox.py.
    cluster = Cluster(nodes=local_nodes(tmp_path, 2), head="n0")
    quick = ProbeSettings.make(quick=True)
    settings = dataclasses.replace(
        quick, links=dataclasses.replace(quick.links, duration_s=0.5, warmup_s=0.2),
        sweep=SweepSettings(sizes=(4096, 65536, 1 << 20), min_time_s=0.1, max_iters=10))
    probe = probe_local(cluster, settings)
    assert [n["name"] for n in probe["nodes"]] == ["n0", "n1"]
    for n in probe["nodes"]:
        assert CONTRACT_NODE_KEYS <= set(n) and n["reachable"]
        assert n["torch"] and n["flops"] > 1e8 and n["cpu_count"] >= 1 and n["memory_bytes"] > 2**28
        assert n["interface"] == "lo"  # the interface carrying 127.0.0.x, for GLOO_SOCKET_IFNAME
        assert abs(n["clock_offset_s"]) < 0.05  # same machine, same clock
        assert n["tcp"]["tcp_rmem"] and len(n["tcp"]["tcp_rmem"]) == 3
    assert sorted((l["src"], l["dst"]) for l in probe["links"]) == [("n0", "n1"), ("n1", "n0")]
    for l in probe["links"]:
        assert CONTRACT_LINK_KEYS <= set(l) and "error" not in l
        assert l["bandwidth_mbit"] > 100 and 0 < l["rtt_ms_min"] <= l["rtt_ms"] <= l["rtt_ms_p95"]
    (sweep,) = probe["collectives"]
    assert sweep["backend"] == "gloo" and sweep["world_size"] == 2 and "error" not in sweep
    assert [r["size_bytes"] for r in sweep["results"]] == [4096, 65536, 1 << 20]
    assert all(r["correct"] and r["time_s"] > 0 for r in sweep["results"])
    assert sweep["alpha_s"] >= 0 and sweep["beta_bytes_per_s"] > 0
    assert blocking_problems(probe) == []
    json.dumps(probe)  # the whole document serialises


def test_node_without_torch_and_node_without_python(tmp_path):
    # An interpreter without site-packages: the venv's python with -S cannot import torch.
    no_torch = tmp_path / "python-no-torch"
    no_torch.write_text(f"#!/bin/sh\nexec {sys.executable} -S \"$@\"\n")
    no_torch.chmod(no_torch.stat().st_mode | stat.S_IEXEC)
    # No node imports torch here, which keeps this test fast.
    nodes = local_nodes(tmp_path, 3, {0: str(no_torch), 1: str(no_torch), 2: str(tmp_path / "no" / "python3")})
    cluster = Cluster(nodes=nodes, head="n0")
    probe = probe_local(cluster, ProbeSettings.make(quick=True))
    by = {n["name"]: n for n in probe["nodes"]}
    assert by["n1"]["reachable"] and by["n1"]["torch"] is None and by["n1"]["flops"] is None
    assert by["n1"]["cpu_count"] >= 1 and by["n1"]["disk_read_mb_s"] > 0  # the facts that need no torch
    assert not by["n2"]["reachable"] and "cannot be run" in by["n2"]["error"]
    assert CONTRACT_NODE_KEYS <= set(by["n2"])  # the contract keys, even for a node with no facts
    # The two usable nodes were still measured, in both directions (the link tool needs no torch).
    assert sorted((l["src"], l["dst"]) for l in probe["links"]) == [("n0", "n1"), ("n1", "n0")]
    assert all(l["bandwidth_mbit"] > 100 for l in probe["links"])
    blocking = {(p["code"], tuple(p["nodes"])) for p in blocking_problems(probe)}
    assert blocking == {("torch_missing", ("n0", "n1")), ("python_unusable", ("n2",))}
    assert probe["collectives"] == []  # no sweep with --quick


def test_store_round_trip_fingerprint_and_age(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    cfile = tmp_path / "site" / "cluster.yaml"
    cfile.parent.mkdir()
    cfile.write_text("nodes: []\n")
    cluster = Cluster(nodes=local_nodes(tmp_path, 2), head="n0", source=str(cfile))
    from vpscluster.probe.store import fingerprint

    probe = {"probed_at_unix": time.time() - 100, "cluster": {"fingerprint": fingerprint(cluster)}, "nodes": []}
    path = save_probe(cluster, probe)
    assert path == tmp_path / "site" / ".vpscluster" / "cluster.probe.json" == probe_path(cluster)
    assert load_probe(cluster) == probe
    assert load_probe(cluster, max_age_s=1000) == probe
    assert load_probe(cluster, max_age_s=10) is None  # too old
    changed = dataclasses.replace(cluster, nodes=local_nodes(tmp_path, 3))
    assert load_probe(changed) is None  # other nodes: that probe is not theirs
    local = Cluster(nodes=local_nodes(tmp_path, 1), head="n0")
    assert probe_path(local) == tmp_path / "home" / ".cache" / "vpscluster" / "local.probe.json"
    assert load_probe(local) is None



def test_a_part_of_the_cluster_gets_the_whole_probe_cut_down(tmp_path, monkeypatch):
    # The nodes that remain after a failure (launch/recovery.subset) use the probe of the whole
    # cluster: their records, the links among them, the problems found again without the others.
    from vpscluster.launch.recovery import subset

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    no_torch = tmp_path / "python-no-torch"  # keeps it fast: no node imports torch
    no_torch.write_text(f"#!/bin/sh\nexec {sys.executable} -S \"$@\"\n")
    no_torch.chmod(no_torch.stat().st_mode | stat.S_IEXEC)
    nodes = local_nodes(tmp_path, 3, {0: str(no_torch), 1: str(no_torch), 2: str(tmp_path / "no" / "python3")})
    whole = Cluster(nodes=nodes, head="n2")
    probe = probe_local(whole, ProbeSettings.make(quick=True))
    save_probe(whole, probe)
    assert ("python_unusable", ("n2",)) in {(p["code"], tuple(p["nodes"])) for p in blocking_problems(probe)}

    part = subset(whole, ["n0", "n1"])
    got = load_probe(part, max_age_s=1000)
    assert got is not None and got["cluster"]["part_of"]["nodes"] == ["n0", "n1", "n2"]
    assert [n["name"] for n in got["nodes"]] == ["n0", "n1"] and got["cluster"]["head"] == "n0"
    assert sorted((l["src"], l["dst"]) for l in got["links"]) == [("n0", "n1"), ("n1", "n0")]
    assert {(p["code"], tuple(p["nodes"])) for p in blocking_problems(got)} == {("torch_missing", ("n0", "n1"))}
    assert load_probe(part, max_age_s=1000) == got and load_probe(whole) == probe  # the whole stays as it was

    # A probe of the part never replaces the whole one, which serves both.
    save_probe(part, {**got, "probed_at_unix": time.time(), "cluster": {**got["cluster"], "part_of": None}})
    assert load_probe(whole) == probe
    # A node changed (another address): not part of that probe any more.
    moved = dataclasses.replace(part, nodes=(part.nodes[0], dataclasses.replace(part.nodes[1], host="127.0.0.9")))
    assert load_probe(moved) is None


def test_cli_json_on_the_local_cluster(cli, tmp_path):
    out = tmp_path / "probe.json"
    env = {"HOME": str(tmp_path / "home")}
    res = cli("probe", "--quick", "--json", "--out", str(out), env=env, cwd=str(tmp_path), timeout=120)
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)  # exactly one JSON document on stdout
    assert set(doc) >= {"nodes", "links", "collectives", "problems"}
    (node,) = doc["nodes"]
    assert CONTRACT_NODE_KEYS <= set(node) and node["name"] == "local" and node["reachable"]
    assert doc["links"] == [] and doc["collectives"] == []
    assert json.loads(out.read_text())["nodes"] == doc["nodes"]
    saved = tmp_path / "home" / ".cache" / "vpscluster" / "local.probe.json"
    assert json.loads(saved.read_text())["probed_at"] == doc["probed_at"]
    assert "node facts" in res.stderr  # progress goes to stderr


def test_cli_rejects_bad_flags_in_one_line(cli):
    res = cli("probe", "--streams", "0", timeout=60)
    assert res.returncode == 2 and res.stdout == ""
    assert res.stderr.strip().count("\n") == 0 and "--streams 0" in res.stderr
    res = cli("probe", "--cluster", "/nonexistent/cluster.yaml", timeout=60)
    assert res.returncode == 2 and "Traceback" not in res.stderr and "cluster" in res.stderr


@pytest.mark.slow
def test_sweep_store_listens_on_master_addr_only():
    # env:// let torch's TCPStore listen on every interface, whatever MASTER_ADDR said; the sweep
    # program's own store binds the address (seen with ss while it runs, then its sums checked).
    import subprocess

    from conftest import free_port
    from vpscluster import nodeside

    port = free_port()
    opts = json.dumps({"sizes": [4096], "min_time_s": 3.0, "max_iters": 100000, "timeout_s": 30, "max_size_s": 10})
    procs = [subprocess.Popen(nodeside.command(sys.executable, "allreduce", opts), stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "RANK": str(r), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.2",
                                   "MASTER_PORT": str(port)}) for r in range(2)]
    try:
        listeners, deadline = [], time.monotonic() + 20
        while not listeners and time.monotonic() < deadline:
            out = subprocess.run(["ss", "-Hltn"], capture_output=True, text=True, timeout=10).stdout
            listeners = [line.split()[3] for line in out.splitlines() if line.split()[3].endswith(f":{port}")]
            time.sleep(0.1)
        assert listeners == [f"127.0.0.2:{port}"], listeners
        out0, _ = procs[0].communicate(timeout=60)
        procs[1].communicate(timeout=30)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert all(p.returncode == 0 for p in procs)
    (result,) = json.loads(out0.strip().splitlines()[-1])["results"]
    assert result["correct"] and result["iters"] > 1
