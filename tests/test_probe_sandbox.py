"""The probe on emulated clusters (network namespaces, tc-shaped links, a real sshd per node).

- uneven rates: every directed pair runs at the slower end's rate, and our link tool agrees with
  iperf3 on the same pair; TCP buffers read on the nodes are flagged against the BDP;
- a node whose python has no torch and a node whose link is down: both reported, rest probed;
- the reference 4-node cluster through the CLI: finishes in about a minute, with the JSON shape.
"""

import json
import subprocess
import time

import pytest
import yaml

from sandbox_fixtures import iperf3_mbit, ssh_run

pytestmark = pytest.mark.sandbox


@pytest.mark.slow
def test_uneven_rates_match_shaping_and_iperf3_and_buffers_are_judged(make_sandbox):
    from vpscluster.cluster.inventory import load_cluster
    from vpscluster.probe.api import run_probe
    from vpscluster.probe.problems import Thresholds, find_problems

    rates = {"node-1": 40.0, "node-2": 80.0, "node-3": 160.0}
    info = make_sandbox(nodes=3, bandwidth="40mbit,80mbit,160mbit")
    # A small receive-buffer limit on node-3 (tcp_rmem is per network namespace): fine on this LAN,
    # too small for a WAN round trip.
    r = ssh_run(info, "node-3", "sysctl -w net.ipv4.tcp_rmem='4096 16384 65536'")
    assert r.returncode == 0, r.stderr
    cluster = load_cluster(info.cluster_file)
    probe = run_probe(cluster, quick=False, sweep=False, save=False)

    links = {(l["src"], l["dst"]): l for l in probe["links"]}
    assert len(links) == 6
    for (src, dst), l in links.items():
        expected = min(rates[src], rates[dst])
        assert l["bandwidth_mbit"] == pytest.approx(expected, rel=0.10), (src, dst, l)
        assert l["rtt_ms"] < 5
    for src, dst in [("node-1", "node-3"), ("node-3", "node-2"), ("node-2", "node-3")]:
        reference = iperf3_mbit(info, src, dst, port=5399)
        assert links[(src, dst)]["bandwidth_mbit"] == pytest.approx(reference, rel=0.05), (src, dst, reference)

    # The TCP settings are the node's own, read there.
    nodes = {n["name"]: n for n in probe["nodes"]}
    for name in rates:
        real = ssh_run(info, name, "cat /proc/sys/net/ipv4/tcp_rmem /proc/sys/net/core/wmem_max").stdout.split()
        assert nodes[name]["tcp"]["tcp_rmem"] == [int(x) for x in real[:3]]
        assert nodes[name]["tcp"]["wmem_max"] == int(real[3])
    assert nodes["node-3"]["tcp"]["tcp_rmem"] == [4096, 16384, 65536]
    assert "tcp_buffer_small" not in {p["code"] for p in probe["problems"]}  # sub-ms RTT: tiny BDP
    # Same nodes, same measured rates, but 20 ms apart (a WAN): 80 Mbit/s x 20 ms = 200 kB in flight.
    wan = dict(probe, links=[dict(l, rtt_ms=20.0) for l in probe["links"]])
    flagged = [p for p in find_problems(wan, Thresholds(rtt_ms=50)) if p["code"] == "tcp_buffer_small"]
    assert [(p["nodes"], "net.ipv4.tcp_rmem" in p["message"]) for p in flagged] == [(["node-3"], True)]


def test_node_without_torch_and_node_down_are_reported(make_sandbox, tmp_path, cli):
    from vpscluster.cluster import sandbox

    info = make_sandbox(nodes=3, bandwidth="100mbit")
    data = yaml.safe_load(open(info.cluster_file))
    data["nodes"][1]["python"] = "/usr/bin/python3"  # Debian's python: no PyTorch there
    data["connect_timeout_s"] = 5
    cfile = tmp_path / "cluster.yaml"
    cfile.write_text(yaml.safe_dump(data))
    if subprocess.run(["/usr/bin/python3", "-c", "import torch"], capture_output=True).returncode == 0:
        pytest.skip("/usr/bin/python3 has PyTorch here; this test needs an interpreter without it")
    sandbox.set_link(info.name, "node-3", False)

    start = time.monotonic()
    res = cli("probe", "--cluster", str(cfile), "--quick", "--json", timeout=120)
    elapsed = time.monotonic() - start
    assert res.returncode == 1, res.stderr  # errors found
    doc = json.loads(res.stdout)
    by = {n["name"]: n for n in doc["nodes"]}
    assert by["node-1"]["reachable"] and by["node-1"]["torch"]
    assert by["node-2"]["reachable"] and by["node-2"]["torch"] is None and by["node-2"]["python"]
    assert not by["node-3"]["reachable"] and "node-3" in by["node-3"]["error"]
    problems = {(p["code"], tuple(p["nodes"])) for p in doc["problems"] if p["severity"] == "error"}
    assert problems == {("torch_missing", ("node-2",)), ("node_unreachable", ("node-3",))}
    # The two live nodes were still measured, both ways, at the shaped rate.
    assert sorted((l["src"], l["dst"]) for l in doc["links"]) == [("node-1", "node-2"), ("node-2", "node-1")]
    assert all(l["bandwidth_mbit"] == pytest.approx(100, rel=0.10) for l in doc["links"])
    assert elapsed < 60, f"a dead node must not stall the probe ({elapsed:.0f} s)"


@pytest.mark.slow
def test_reference_cluster_probe_through_the_cli(make_sandbox, cli):
    info = make_sandbox(nodes=4, bandwidth="100mbit", cpu=0.45)
    start = time.monotonic()
    res = cli("probe", "--cluster", info.cluster_file, "--json", timeout=180)
    elapsed = time.monotonic() - start
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    print(f"4-node probe took {elapsed:.1f} s (probe's own duration {doc['duration_s']} s)")
    names = [f"node-{i}" for i in range(1, 5)]
    assert [n["name"] for n in doc["nodes"]] == names
    for n in doc["nodes"]:
        assert {"name", "cpu_count", "memory_bytes", "gpus", "disk_read_mb_s", "python", "torch", "cuda", "flops"} <= set(n)
        assert n["cpu_share"] < 0.7  # the 0.45-core quota is felt
        assert n["interface"] == "eth0"
    assert len(doc["links"]) == 12
    for l in doc["links"]:
        assert {"src", "dst", "bandwidth_mbit", "rtt_ms"} <= set(l)
        assert l["bandwidth_mbit"] == pytest.approx(100, rel=0.10), l
    (sweep,) = doc["collectives"]
    assert sweep["world_size"] == 4 and all(r["correct"] for r in sweep["results"])
    assert len(sweep["results"]) >= 5
    # The ring all-reduce's bus bandwidth cannot beat the links; on 100 Mbit/s it gets most of it,
    # and the fit's rate is the one the largest message ran at (its latency is a few ms of ~1 s).
    bus_mbit = sweep["bus_beta_bytes_per_s"] * 8 / 1e6
    largest = sweep["results"][-1]
    assert 50 < bus_mbit < 105, (bus_mbit, sweep["results"])
    if largest["time_s"] > 0.5:
        assert bus_mbit == pytest.approx(largest["busbw_mbit"], rel=0.08), (bus_mbit, sweep["results"])
    assert {p["severity"] for p in doc["problems"]} <= {"info"}
    saved = json.loads(open(doc["saved_to"]).read())
    assert saved["probed_at"] == doc["probed_at"]
    assert elapsed < 90, f"probe took {elapsed:.0f} s"


def test_nodes_that_cannot_reach_each_other(make_sandbox, cli):
    info = make_sandbox(nodes=3, bandwidth="100mbit")
    # node-2 drops everything towards node-1 (a firewall between two providers, say); both stay
    # reachable over SSH from here.
    r = ssh_run(info, "node-2", f"ip route add blackhole {info.node('node-1').address}/32")
    assert r.returncode == 0, r.stderr
    start = time.monotonic()
    res = cli("probe", "--cluster", info.cluster_file, "--quick", "--sweep", "--json", timeout=120)
    elapsed = time.monotonic() - start
    assert res.returncode == 1, res.stderr
    doc = json.loads(res.stdout)
    assert all(n["reachable"] for n in doc["nodes"])
    failed = sorted((l["src"], l["dst"]) for l in doc["links"] if l.get("error"))
    assert failed == [("node-1", "node-2"), ("node-2", "node-1")]
    good = [l for l in doc["links"] if not l.get("error")]
    assert len(good) == 4 and all(l["bandwidth_mbit"] == pytest.approx(100, rel=0.10) for l in good)
    errors = sorted((p["code"], tuple(p["nodes"])) for p in doc["problems"] if p["severity"] == "error")
    assert errors == [("link_failed", ("node-1", "node-2"))] * 2
    assert doc["collectives"] == []  # no sweep that could only hang on its rendezvous
    assert elapsed < 60, f"{elapsed:.0f} s"
