"""Exporters serve real values: scraped over HTTP during a 2-rank local run and checked against
metrics.jsonl; the node's CPU figure is usage over the cgroup quota (a busy loop in a 0.3-core
sandbox node reads ~100%, an idle node ~0)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from sandbox_fixtures import ns_popen


def scrape(address: str, port: int) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} of one exporter."""
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://{address}:{port}/metrics", timeout=5).read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(samples: dict, name: str, **labels) -> float:
    want = {k: str(v) for k, v in labels.items()}
    found = [v for (n, lab), v in samples.items() if n == name and want.items() <= dict(lab).items()]
    assert found, f"{name} {labels} not exported"
    return sum(found)


def cpu_seconds_of(pid: int) -> float:
    """utime + stime of a process, the independent truth the exporter's figure is checked against."""
    import os

    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_local_run_exporters_match_metrics_jsonl(tmp_path):
    from vpscluster.launch.train import train
    from vpscluster.train.config import TrainConfig

    run_dir = tmp_path / "mon-run"
    cfg = TrainConfig(nodes=2, max_steps=16, eval_every=100, checkpoint_every=100, threads_per_rank=1,
                      run_dir=str(run_dir))
    seen: dict = {}

    def on_event(ev):
        if ev["event"] == "start":
            seen["exporters"] = ev["exporters"]
        elif ev["event"] == "step" and ev["step"] == 8:
            # Exporters first, then the file: the file is written before the exporter is updated,
            # so it holds at least the steps the exporter has seen.
            seen["ranks"] = [scrape(e["address"], e["rank_port"]) for e in seen["exporters"]]
            node = next(e for e in seen["exporters"] if e["node_port"])
            seen["node"] = scrape(node["address"], node["node_port"])
            seen["lines"] = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]

    report = train(cfg, on_event=on_event)
    assert report["steps"] == 16
    # What the exporters cost each rank is counted (updates + serving the scrapes above).
    for r in report["per_rank"]:
        assert 0 < r["exporter_cpu_seconds"] < 0.5 * r["wall_seconds"], report["per_rank"]
    exporters = json.loads((run_dir / "exporters.json").read_text())["exporters"]
    assert exporters == seen["exporters"]
    assert [e["rank"] for e in exporters] == [0, 1] and all(e["address"] == "127.0.0.1" for e in exporters)

    rank0 = seen["ranks"][0]
    step = int(value(rank0, "vpscluster_step", rank=0))
    assert step >= 8
    lines = [x for x in seen["lines"] if "loss" in x and x["step"] <= step]
    assert [x["step"] for x in lines] == list(range(1, step + 1))
    assert value(rank0, "vpscluster_bytes_sent_total", rank=0) == sum(x["bytes_sent"] for x in lines) > 0
    assert value(rank0, "vpscluster_tokens_total", rank=0) == sum(x["tokens"] for x in lines) / 2
    assert value(rank0, "vpscluster_loss", rank=0) == pytest.approx(lines[-1]["loss"])
    assert value(rank0, "vpscluster_step_seconds_count", rank=0) == step
    assert value(rank0, "vpscluster_step_seconds_sum", rank=0) == pytest.approx(sum(x["step_seconds"] for x in lines))
    assert value(rank0, "vpscluster_sync_latency_seconds_count", rank=0, kind="step") == step
    # The other rank trains the same steps, give or take the one in flight.
    assert abs(value(seen["ranks"][1], "vpscluster_step", rank=1) - step) <= 1
    assert value(seen["ranks"][1], "vpscluster_bytes_sent_total", rank=1) > 0

    node = seen["node"]
    assert value(node, "vpscluster_node_cpu_capacity_cores") >= 1
    assert 0 <= value(node, "vpscluster_node_cpu_utilization") <= 1
    assert value(node, "vpscluster_node_network_transmit_bytes_total", interface="lo") > 0
    assert value(node, "vpscluster_node_memory_total_bytes") > value(node, "vpscluster_node_memory_used_bytes") > 0
    assert value(node, "vpscluster_node_disk_total_bytes") > 0


@pytest.mark.sandbox
def test_cpu_utilization_is_over_the_quota(make_sandbox):
    """Inside `ip netns exec` the cgroup file system is not mounted: the quota is the one the
    launcher passes (the probe's), the usage is summed over the node cgroup's processes."""
    import secrets

    info = make_sandbox(nodes=2, bandwidth="100mbit", cpu=0.3, name=f"mon-{secrets.token_hex(3)}")
    busy_node, idle_node = info.nodes[0], info.nodes[1]
    procs = []
    try:
        for n in (busy_node, idle_node):
            procs.append(ns_popen(info, n.name, [sys.executable, "-m", "vpscluster.probe.node_exporter", "--node", n.name,
                                                 "--bind", n.address, "--cpu-quota-cores", "0.3"],
                                 stdout=subprocess.PIPE, text=True))
        for p in procs:
            assert "node exporter" in p.stdout.readline()
        loop = ns_popen(info, busy_node.name, [sys.executable, "-S", "-c", "while True: pass"])
        procs.append(loop)
        time.sleep(1.0)
        for n in (busy_node, idle_node):
            scrape(n.address, 9471)  # the window starts here
        t0, c0 = time.monotonic(), cpu_seconds_of(loop.pid)
        time.sleep(3.0)
        busy = scrape(busy_node.address, 9471)
        truth = (cpu_seconds_of(loop.pid) - c0) / ((time.monotonic() - t0) * 0.3)
        idle = scrape(idle_node.address, 9471)
    finally:
        for p in procs:
            p.kill()
            p.wait(timeout=10)
    assert value(busy, "vpscluster_node_cpu_capacity_cores") == pytest.approx(0.3)
    # ~100% of its 0.3 core on a quiet machine (not ~15% of the host); on a loaded shared machine
    # what the loop really got, always over the quota, not over the host's CPUs.
    util = value(busy, "vpscluster_node_cpu_utilization")
    assert util == pytest.approx(truth, abs=0.12) and util > 0.1
    assert value(idle, "vpscluster_node_cpu_utilization") < 0.15
    assert value(busy, "vpscluster_node_cpu_seconds_total") > 0.5


@pytest.mark.tools
def test_cpu_quota_read_from_the_cgroup(tmp_path):
    """Where the cgroup file system is visible the quota and usage come from it (a v1 cpu cgroup
    of our own, 0.3 core): a busy loop reads ~100%, the same cgroup idle ~0."""
    import os

    from vpscluster.probe.node_exporter import CpuMeter, find_cpu_source

    root = Path("/sys/fs/cgroup/cpu")
    if os.geteuid() != 0 or not (root / "cpu.cfs_quota_us").exists():
        pytest.skip("needs root and a cgroup-v1 cpu hierarchy at /sys/fs/cgroup/cpu")
    cg = root / f"mon-{os.getpid()}"
    cg.mkdir()
    procs = []
    try:
        (cg / "cpu.cfs_period_us").write_text("100000")
        (cg / "cpu.cfs_quota_us").write_text("30000")
        idle = subprocess.Popen(["sleep", "30"])
        procs.append(idle)
        (cg / "cgroup.procs").write_text(str(idle.pid))
        source = find_cpu_source(f"/proc/{idle.pid}/cgroup")
        assert source.quota_cores == pytest.approx(0.3) and source.cgroup_dir == str(cg)
        meter = CpuMeter(source)
        meter.read()
        time.sleep(1.0)
        assert meter.read()[1] < 0.1
        busy = subprocess.Popen([sys.executable, "-S", "-c", "while True: pass"])
        procs.append(busy)
        (cg / "cgroup.procs").write_text(str(busy.pid))
        time.sleep(0.5)
        meter.read()
        t0, c0 = time.monotonic(), cpu_seconds_of(busy.pid)
        time.sleep(2.0)
        util = meter.read()[1]
        truth = (cpu_seconds_of(busy.pid) - c0) / ((time.monotonic() - t0) * 0.3)
        # ~1 on a quiet machine; on a loaded shared one the loop may get less than its quota, so
        # the figure must match what it really got, over the quota (not over the host's CPUs).
        assert util == pytest.approx(truth, abs=0.12) and util > 0.1
    finally:
        for p in procs:
            p.kill()
            p.wait(timeout=10)
        cg.rmdir()


def test_metric_definitions_are_unique_and_served_names_match():
    from vpscluster import telemetry as T

    names = [m.name for m in T.ALL_METRICS]
    assert len(names) == len(set(names))
    assert all(n.startswith("vpscluster_") and not n.endswith("_total") for n in names)
    assert len({T.NODE_PORT, T.PROMETHEUS_PORT, T.rank_port(0), T.rank_port(7)}) == 4


def test_node_exporter_host_cpu_figure_without_quota():
    from vpscluster.probe.node_exporter import CpuMeter, CpuSource

    meter = CpuMeter(CpuSource(None, None, None))
    meter.read()
    t = time.monotonic()
    while time.monotonic() - t < 0.6:
        pass
    used, util = meter.read()
    assert used > 0 and 0 < util <= 1
    assert meter.capacity_cores >= 1


def test_outer_syncs_are_their_own_latency_kind():
    """A step during which DiLoCo's outer-sync count rose is an outer sync's latency."""
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from vpscluster.train.exporter import RankExporter

    e = RankExporter(rank=3, local_rank=9, node="n", bind="127.0.0.1")  # not started: nothing served
    e.start_outer_count(0)
    for step, outer, comm_s in ((1, 0, 0.01), (2, 1, 2.0), (3, 1, 0.02), (4, 2, 3.0)):
        e.step(step, 3.0, 100, 50, 4.0, comm_s, 10, outer)
    samples = {}
    for fam in text_string_to_metric_families(generate_latest(e.registry).decode()):
        for s in fam.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    assert value(samples, "vpscluster_outer_syncs_total") == 2
    assert value(samples, "vpscluster_sync_latency_seconds_count", kind="outer") == 2
    assert value(samples, "vpscluster_sync_latency_seconds_sum", kind="outer") == pytest.approx(5.0)
    assert value(samples, "vpscluster_sync_latency_seconds_count", kind="step") == 2
    assert value(samples, "vpscluster_bytes_sent_total", rank=3, node="n") == 40


def test_exporter_cpu_seconds_counts_the_scrapes_it_serves(tmp_path):
    """The serving threads' CPU clocks: many scrapes cost measurably more than none."""
    from vpscluster.train.exporter import RankExporter

    ex = RankExporter(rank=0, local_rank=0, node="here", bind="127.0.0.1", workdir=str(tmp_path))
    ex.start()
    try:
        ex.step(1, 2.5, 100, 100, 0.5, 0.1, 1000)
        idle = ex.cpu_seconds()
        time.sleep(0.5)
        assert ex.cpu_seconds() - idle < 0.02  # nothing scraped: next to nothing spent
        for _ in range(40):
            scrape("127.0.0.1", ex.rank_port)
            scrape("127.0.0.1", ex.node_port)
        spent = ex.cpu_seconds() - idle
        assert spent > 0.005, spent
    finally:
        ex.close()
    assert ex.cpu_seconds() == pytest.approx(idle + spent, abs=0.05)  # kept once closed
