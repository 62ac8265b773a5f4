"""`monitor up` starts the real Prometheus (Debian's binary) on the local cluster's head; it scrapes
the node exporter and, once `train` publishes them, every rank; the load queries answer from it;
`monitor down` leaves nothing running."""

from __future__ import annotations

import json
import shutil
import threading
import time

import pytest

from conftest import free_port, pid_alive, run_cli

pytestmark = [pytest.mark.tools, pytest.mark.skipif(shutil.which("prometheus") is None, reason="no prometheus binary (apt install prometheus)")]


def wait_for(check, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(0.5)
    raise AssertionError(f"{what}: not within {timeout_s} s (last: {last})")


def test_monitor_up_scrapes_node_and_ranks_then_down(tmp_path, monkeypatch):
    from vpscluster.cluster.inventory import local_cluster
    from vpscluster.launch.train import train
    from vpscluster.monitor import query
    from vpscluster.monitor.server import load_record
    from vpscluster.train.config import TrainConfig

    monkeypatch.setenv("HOME", str(tmp_path))  # the monitor record lives under ~/.cache
    monkeypatch.chdir(tmp_path)  # the local cluster's workdir: monitor/ goes here
    env = {"HOME": str(tmp_path)}
    # The local cluster's record says its link carries 1 Mbit/s (as a cluster file's advertised
    # rate would): the run's real loopback traffic fills it, and `top` must say so.
    from vpscluster.probe.store import fingerprint, save_probe

    save_probe(local_cluster(), {"cluster": {"fingerprint": fingerprint(local_cluster())}, "probed_at_unix": time.time(),
                                 "nodes": [{"name": "local", "advertised_bandwidth_mbit": 1}], "links": []})
    port = free_port()
    r = run_cli("monitor", "up", "--port", str(port), "--scrape-interval", "1", "--json", env=env, cwd=str(tmp_path), timeout=120)
    assert r.returncode == 0, r.stderr
    rec = json.loads(r.stdout)
    try:
        assert rec["url"] == f"http://127.0.0.1:{port}" and pid_alive(rec["prometheus_pid"])
        prom = query.Prometheus(rec["url"])
        wait_for(lambda: [t for t in prom.targets() if t["health"] == "up" and t["labels"]["exporter"] == "node"], 30,
                 "the node exporter scraped")
        assert (tmp_path / "monitor" / "prometheus.yml").exists()

        # A run publishes its ranks; Prometheus picks them up without a restart.
        # The checks below need the run alive: they were done ~1 s after Prometheus first scraped
        # both ranks (~2 s into the training) here; the rest of the budget is waited out after them.
        cfg = TrainConfig(nodes=2, max_steps=100000, time_budget_s=15, eval_every=100000, checkpoint_every=100000,
                          threads_per_rank=1, run_dir=str(tmp_path / "runs" / "mon-run"))
        done: dict = {}
        # As the CLI does: monitoring subscribes to the launch's events (the launcher imports no monitoring).
        from vpscluster.monitor.targets import run_targets

        targets = run_targets(local_cluster(), "mon-run", print)
        worker = threading.Thread(target=lambda: done.setdefault("report", train(cfg, on_event=targets)), daemon=True)
        worker.start()

        def ranks_up():
            assert worker.is_alive(), "the run ended before Prometheus scraped its ranks"
            up = [t for t in prom.targets() if t["labels"].get("exporter") == "rank" and t["health"] == "up"]
            return up if len(up) == 2 else None

        # Starting two torch ranks takes seconds on a quiet machine, minutes on a loaded shared one.
        ranks = wait_for(ranks_up, 300, "both ranks scraped")
        assert sorted(t["labels"]["rank"] for t in ranks) == ["0", "1"]
        def both_stepping():
            steps = {lab["rank"]: v for lab, v in prom.query("vpscluster_step") if v > 0}
            return steps if len(steps) == 2 else None

        assert set(wait_for(both_stepping, 60, "steps of both ranks")) == {"0", "1"}

        cpu = wait_for(lambda: query.cpu_utilization(prom), 30, "cpu utilisation per node")
        assert set(cpu) == {"local"} and 0 <= cpu["local"] <= 1
        rates = query.link_rates(prom, window="10s", include_loopback=True)
        assert rates["local"]["lo"]["tx"] > 0  # gloo's all-reduces go over loopback
        latency = wait_for(lambda: query.sync_latency(prom, window="30s").get("step"), 30, "sync latency quantiles")
        assert 0 < latency["p50"] <= latency["p95"]
        # `top --json` during the run: every node, with non-zero rates and the ranks' step time.
        top = json.loads(run_cli("top", "--json", "--window", "10s", env=env, cwd=str(tmp_path), timeout=60).stdout)
        assert [n["node"] for n in top["nodes"]] == ["local"]
        (row,) = top["nodes"]
        assert row["tx_bytes_per_s"] > 0 and row["rx_bytes_per_s"] > 0 and row["step_seconds"] > 0
        assert 0 <= row["comm_share"] <= 1 and row["sync_latency_s"] > 0
        assert top["run"]["ranks"] == 2 and top["run"]["loss"] > 0
        # Alerts: the 1 Mbit/s link is full (the all-reduces move MB/s), in the row and the list;
        # the CPU alert exactly when the node is above 80% of what it has.
        assert row["link_capacity_bytes_per_s"] == pytest.approx(125_000)
        link_alerts = [a for a in row["alerts"] if a.startswith("link ") and a.endswith("% full")]
        assert len(link_alerts) == 1 and int(link_alerts[0].split()[1].rstrip("%")) > 90, row
        assert f"local: {link_alerts[0]}" in top["alerts"]
        cpu_alerts = [a for a in row["alerts"] if a.startswith("CPU ")]
        assert bool(cpu_alerts) == (row["cpu_utilization"] > 0.8), row
        assert all(f"local: {a}" in top["alerts"] for a in row["alerts"]) and len(top["alerts"]) == len(row["alerts"])
        worker.join(timeout=120)
        assert done["report"]["stopped_by"] == "time_budget"

        # The ended run's targets go (file discovery notices within seconds); the node's stays.
        wait_for(lambda: {t["labels"]["exporter"] for t in prom.targets()} == {"node"}, 60, "the run's targets removed")
        status = json.loads(run_cli("monitor", "status", "--json", env=env, cwd=str(tmp_path)).stdout)
        assert status["running"] and [t["health"] for t in status["targets"]] == ["up"]
    finally:
        down = run_cli("monitor", "down", env=env, cwd=str(tmp_path), timeout=120)
    assert down.returncode == 0, down.stderr
    assert not pid_alive(rec["prometheus_pid"])
    assert not any(pid_alive(e["pid"]) for e in rec["node_exporters"].values())
    assert load_record(local_cluster()) is None
    again = run_cli("monitor", "down", env=env, cwd=str(tmp_path))
    assert again.returncode == 0 and "not running" in again.stdout


def test_dashboard_has_a_panel_per_metric(cli):
    from vpscluster import telemetry as T

    r = cli("monitor", "dashboard")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    exprs = " ".join(t["expr"] for p in doc["panels"] if p["type"] == "timeseries" for t in p["targets"])
    for m in T.ALL_METRICS:
        assert (m.name + "_bucket" if m.kind == "histogram" else m.sample) in exprs, m.name


def test_top_renders_alerts_for_busy_nodes_full_links_and_slow_syncs():
    from rich.console import Console

    from vpscluster.monitor.top import render

    row = {"node": "a", "cpu_utilization": 0.93, "cpu_capacity_cores": 0.5, "memory_used_bytes": 2e9,
           "memory_total_bytes": 8e9, "tx_bytes_per_s": 12.2e6, "rx_bytes_per_s": 1e6, "link_capacity_bytes_per_s": 12.5e6,
           "step_seconds": 0.4, "comm_share": 0.6, "sync_latency_s": 0.9, "sync_latency_median_s": 0.1,
           "alerts": ["CPU 93% of its quota: give it no new work", "link 98% full", "sync latency 900 ms, 9.0x its median: trace the path with `mtr 10.0.0.2`"]}
    idle = {k: None for k in row} | {"node": "b", "alerts": []}
    snap = {"prometheus": "http://h:9470", "window": "30s", "nodes": [row, idle],
            "run": {"step": 10, "loss": 3.2, "tokens_per_s": 1234.0, "ranks": 2},
            "alerts": [f"a: {a}" for a in row["alerts"]]}
    con = Console(record=True, width=160)
    con.print(render(snap))
    text = con.export_text()
    assert "93% of 0.5" in text and "98% of 12.5 MB/s" in text and "mtr 10.0.0.2" in text
    assert "loss 3.200" in text and "1,234 tokens/s" in text


def test_generated_configuration_snapshots():
    """What `monitor up` writes and runs on the nodes, as snapshots (VPSC_UPDATE_SNAPSHOTS=1 regenerates)."""
    from test_launch_commands import check_snapshot

    from vpscluster.monitor import server

    exporters = [{"rank": 0, "local_rank": 0, "node": "a", "address": "10.0.0.2", "rank_port": 9480, "node_port": 9471},
                 {"rank": 1, "local_rank": 0, "node": "b", "address": "10.0.0.3", "rank_port": 9480, "node_port": 9471}]
    check_snapshot("monitor_generated.json", {
        "prometheus.yml": json.loads(server.prometheus_config("/srv/vpscluster/monitor", 5.0)),
        "targets/nodes.json": server.node_targets({"a": {"address": "10.0.0.2", "port": 9471, "pid": 1},
                                                   "b": {"address": "10.0.0.3", "port": 9471, "pid": 2}}),
        "targets/run.json": server.run_targets("run-1", exporters),
        "node exporter command": server._node_exporter_cmd("/opt/venv/bin/python", "a", "10.0.0.2", "/srv/vpscluster",
                                                           "/srv/vpscluster/code/src", 0.45, 12.5e6),
    })


def test_up_without_the_binary_is_one_line_and_starts_nothing(tmp_path):
    env = {"HOME": str(tmp_path)}
    r = run_cli("monitor", "up", "--prometheus", str(tmp_path / "no-such-prometheus"), env=env, cwd=str(tmp_path), timeout=120)
    assert r.returncode != 0
    assert r.stderr.strip().count("\n") == 0 and "apt install prometheus" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "monitor" / "node-exporter.pid").exists()
    status = json.loads(run_cli("monitor", "status", "--json", env=env, cwd=str(tmp_path)).stdout)
    assert status == {"running": False}


def test_top_alerts_when_sync_latency_jumps_above_its_median(tmp_path, monkeypatch):
    """The sync-latency alert end to end: a rank exporter (the one training uses) reports syncs of
    ~50 ms, then of ~600 ms (a congested path); the real Prometheus scrapes it; `top`'s snapshot
    names the node with the hint to trace the path with mtr - and did not before the jump."""
    from vpscluster.cluster.inventory import local_cluster
    from vpscluster.monitor import server
    from vpscluster.monitor.top import snapshot
    from vpscluster.train.exporter import RankExporter

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    env = {"HOME": str(tmp_path)}
    r = run_cli("monitor", "up", "--port", str(free_port()), "--scrape-interval", "1", "--json", env=env,
                cwd=str(tmp_path), timeout=120)
    assert r.returncode == 0, r.stderr
    cluster = local_cluster()
    ex = RankExporter(rank=0, local_rank=1, node=cluster.head, bind="127.0.0.1", workdir=str(tmp_path))
    ex.start()
    try:
        server.publish_run_targets(cluster, "sync-alert", [ex.endpoint()])
        from vpscluster.monitor import query

        prom = query.Prometheus(json.loads(r.stdout)["url"])
        wait_for(lambda: [t for t in prom.targets() if t["labels"].get("exporter") == "rank" and t["health"] == "up"],
                 60, "the rank scraped")

        def steps(n: int, sync_s: float, first: int, stop: threading.Event | None = None) -> int:
            for i in range(n):  # ~10 steps per second, each with one gradient sync
                if stop is not None and stop.is_set():
                    break
                ex.step(first + i, 3.0, 1000, 500, sync_s + 0.05, sync_s, 1 << 20)
                time.sleep(0.1)
            return first + n

        step = steps(150, 0.05, 1)  # 15 s of normal syncs: the median

        def sync_row():
            row = snapshot(cluster, window="5s")["nodes"][0]
            return row if row["sync_latency_s"] and row["sync_latency_median_s"] else None

        calm = wait_for(sync_row, 30, "sync latency and its median")
        assert not [a for a in calm["alerts"] if a.startswith("sync latency")], calm
        # Slow syncs from now on (at most 10 s: fewer than the normal ones, so the median stays).
        stop = threading.Event()
        slow = threading.Thread(target=steps, args=(100, 0.6, step, stop), daemon=True)
        slow.start()
        try:
            def sync_alert():
                snap = snapshot(cluster, window="3s")
                return snap if any(a.startswith("sync latency") for a in snap["nodes"][0]["alerts"]) else None

            snap = wait_for(sync_alert, 30, "a sync-latency alert once the slow syncs are scraped")
        finally:
            stop.set()
            slow.join(timeout=10)
        row = snap["nodes"][0]
        alert = [a for a in row["alerts"] if a.startswith("sync latency")]
        assert alert and "its median: trace the path with `mtr 127.0.0.1`" in alert[0], row
        # the median stays with the normal syncs; the window's mean has moved above 3x it
        assert row["sync_latency_median_s"] < 0.1 and row["sync_latency_s"] > 3 * row["sync_latency_median_s"], row
        assert f"{cluster.head}: {alert[0]}" in snap["alerts"]
    finally:
        ex.close()
        down = run_cli("monitor", "down", env=env, cwd=str(tmp_path), timeout=120)
        assert down.returncode == 0, down.stderr
