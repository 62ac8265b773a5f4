"""The human report renders every case (unreachable node, failed link, failed or fitted sweep)."""

import io

from rich.console import Console

from vpscluster.probe.collectives import summarize
from vpscluster.probe.problems import find_problems
from vpscluster.probe.report import render


def synthetic_probe():
    nodes = [
        {"name": "fra-1", "reachable": True, "cpu_count": 8, "cpu_share": 8.0, "memory_bytes": 32 * 2**30,
         "gpus": [{"name": "NVIDIA L4", "memory_bytes": 24 * 2**30}], "disk_read_mb_s": 950.0, "python": "3.11.7",
         "torch": "2.13.0", "cuda": "12.6", "flops": 1.2e14, "clock_offset_s": 0.0, "advertised_bandwidth_mbit": 1000.0},
        {"name": "ams-2", "reachable": True, "cpu_count": 4, "cpu_share": 0.45, "memory_bytes": 8 * 2**30, "gpus": [],
         "disk_read_mb_s": 60.0, "python": "3.11.7", "torch": None, "cuda": None, "flops": None,
         "clock_offset_s": 0.0123, "advertised_bandwidth_mbit": 1000.0},
        {"name": "nyc-3", "reachable": False, "host": "198.51.100.7", "error": "nyc-3: cannot connect: timed out"},
    ]
    links = [{"src": "fra-1", "dst": "ams-2", "bandwidth_mbit": 312.5, "rtt_ms": 18.2},
             {"src": "ams-2", "dst": "fra-1", "bandwidth_mbit": None, "rtt_ms": None, "error": "refused"}]
    sweep = summarize({"backend": "gloo", "world_size": 2, "results": [
        {"size_bytes": 4096, "iters": 50, "time_s": 0.02, "correct": True},
        {"size_bytes": 1 << 20, "iters": 5, "time_s": 0.1, "correct": True}]}, ["fra-1", "ams-2"])
    probe = {"nodes": nodes, "links": links, "duration_s": 12.3, "saved_to": "/tmp/x.probe.json",
             "collectives": [sweep, {"op": "all_reduce", "nodes": ["fra-1", "ams-2"], "error": "ams-2: timed out"}]}
    probe["problems"] = find_problems(probe)
    return probe


def test_render_every_case():
    buf = io.StringIO()
    render(synthetic_probe(), Console(file=buf, width=120, color_system=None))
    text = buf.getvalue()
    for expected in ("fra-1", "ams-2", "nyc-3", "unreachable", "missing", "NVIDIA L4", "0.45/4", "+12.3",
                     "312.5", "failed", "18.20", "All-reduce sweep (gloo, 2 nodes)", "α =", "bus",
                     "all-reduce sweep failed: ams-2: timed out", "torch_missing", "node_unreachable",
                     "link_failed", "slow_disk", "bandwidth_below_advertised", "probed 3 node(s) in 12.3 s"):
        assert expected in text, expected


def test_render_a_clean_single_node():
    probe = {"nodes": [{"name": "local", "reachable": True, "cpu_count": 2, "cpu_share": 2.0, "memory_bytes": 2**34,
                        "gpus": [], "disk_read_mb_s": 800.0, "python": "3.11.7", "torch": "2.13.0", "cuda": None,
                        "flops": 8e10, "clock_offset_s": 0.0}],
             "links": [], "collectives": [], "problems": [], "duration_s": 3.0}
    buf = io.StringIO()
    render(probe, Console(file=buf, width=80, color_system=None))
    assert "No problems found." in buf.getvalue() and "Bandwidth" not in buf.getvalue()
