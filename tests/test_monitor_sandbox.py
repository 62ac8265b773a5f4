"""Monitoring a 3-node sandbox (SSH nodes in their own network namespaces): `monitor up` starts a
node exporter on every node and the real Prometheus on the head; a `train --cluster` run's
exporters are scraped over HTTP and agree with metrics.jsonl; Prometheus scrapes every target;
the load query answers per node; `top --json` shows every node with non-zero rates; `monitor
down` leaves nothing running."""

from __future__ import annotations

import gzip
import json
import secrets
import shutil
import threading
from pathlib import Path

import pytest

from conftest import pid_alive, run_cli
from test_monitor_exporters import scrape, value
from sandbox_fixtures import TEST_PREFIX, node_run_dir
from test_monitor_prometheus import wait_for

pytestmark = [pytest.mark.sandbox, pytest.mark.slow,
              pytest.mark.skipif(shutil.which("prometheus") is None, reason="no prometheus binary (apt install prometheus)")]

REPO = Path(__file__).resolve().parents[1]


def test_monitor_a_sandbox_run(make_sandbox, tmp_path):
    from vpscluster.cluster.inventory import load_cluster
    from vpscluster.launch.train import train
    from vpscluster.monitor import query
    from vpscluster.train.config import TrainConfig

    info = make_sandbox(nodes=3, bandwidth="100mbit", name=f"{TEST_PREFIX}mon-{secrets.token_hex(3)}")
    cluster = load_cluster(info.cluster_file)
    r = run_cli("monitor", "up", "--cluster", info.cluster_file, "--scrape-interval", "1", "--json", timeout=300)
    assert r.returncode == 0, r.stderr
    rec = json.loads(r.stdout)
    try:
        head = info.node(cluster.head)
        assert rec["url"] == f"http://{head.address}:9470"
        assert {n: e["address"] for n, e in rec["node_exporters"].items()} == {n.name: n.address for n in info.nodes}
        prom = query.Prometheus(rec["url"])
        wait_for(lambda: sorted(t["labels"]["node"] for t in prom.targets() if t["health"] == "up") == sorted(n.name for n in info.nodes),
                 60, "every node exporter scraped")

        corpus = tmp_path / "corpus.txt"
        with gzip.open(REPO / "src" / "vpscluster" / "data" / "kjv.txt.gz", "rt") as f:
            corpus.write_text(f.read(400_000))
        # The checks below need the run alive: they were done ~6 s into its training here (~17 s
        # once on a busier machine); the rest of the budget is waited out after them.
        # One torch thread per rank: the sandbox's three nodes share this machine's 2 cores (no speed
        # figure is checked).
        cfg = TrainConfig(cluster=info.cluster_file, data=str(corpus), max_steps=100000, time_budget_s=22,
                          eval_every=100000, checkpoint_every=100000, threads_per_rank=1, run_dir=str(tmp_path / "mon-run"))
        seen: dict = {}
        done: dict = {}

        # As the CLI does: monitoring subscribes to the launch's events (the launcher imports no monitoring).
        from vpscluster.monitor.targets import chain, run_targets

        def on_event(ev):
            if ev["event"] == "start":
                seen["exporters"] = ev["exporters"]

        events = chain(on_event, run_targets(cluster, "mon-run", print))
        worker = threading.Thread(target=lambda: done.setdefault("report", train(cfg, on_event=events)), daemon=True)
        worker.start()

        def ranks_up():
            assert worker.is_alive(), "the run ended before Prometheus scraped its ranks"
            up = [t for t in prom.targets() if t["labels"].get("exporter") == "rank" and t["health"] == "up"]
            return up if len(up) == 3 else None

        ranks = wait_for(ranks_up, 400, "the 3 ranks scraped")
        assert sorted(t["labels"]["node"] for t in ranks) == sorted(n.name for n in info.nodes)

        # Every exporter over HTTP, checked against rank 0's metrics.jsonl (on its node's disk).
        exporters = seen["exporters"]
        assert {e["node"]: e["address"] for e in exporters} == {n.name: n.address for n in info.nodes}
        wait_for(lambda: all(value(scrape(e["address"], e["rank_port"]), "vpscluster_step") >= 3 for e in exporters), 120,
                 "three steps on every rank")
        rank0 = next(e for e in exporters if e["rank"] == 0)
        samples = scrape(rank0["address"], rank0["rank_port"])
        metrics_file = node_run_dir(info.node(rank0["node"]), tmp_path / "mon-run") / "metrics.jsonl"
        lines = [json.loads(x) for x in metrics_file.read_text().splitlines()]
        step = int(value(samples, "vpscluster_step"))
        upto = [x for x in lines if "loss" in x and x["step"] <= step]
        assert len(upto) == step
        assert value(samples, "vpscluster_bytes_sent_total") == sum(x["bytes_sent"] for x in upto) > 0
        for e in exporters:
            node = scrape(e["address"], e["node_port"])
            veth_tx = [v for (name, lab), v in node.items()
                       if name == "vpscluster_node_network_transmit_bytes_total" and dict(lab)["interface"] != "lo"]
            assert max(veth_tx) > 0

        cpu = wait_for(lambda: (lambda c: c if len(c) == 3 else None)(query.cpu_utilization(prom)), 60, "CPU per node")
        assert set(cpu) == {n.name for n in info.nodes} and all(0 <= v <= 1 for v in cpu.values())
        top = json.loads(run_cli("top", "--cluster", info.cluster_file, "--json", "--window", "10s", timeout=60).stdout)
        assert [r["node"] for r in top["nodes"]] == [n.name for n in info.nodes]
        assert all(r["tx_bytes_per_s"] > 0 and r["rx_bytes_per_s"] > 0 for r in top["nodes"]), top["nodes"]
        assert top["run"]["ranks"] == 3

        worker.join(timeout=300)
        assert done["report"]["world_size"] == 3 and done["report"]["stopped_by"] == "time_budget"
        wait_for(lambda: {t["labels"]["exporter"] for t in prom.targets()} == {"node"}, 60, "the run's targets removed")

        # The run's report: a cluster run has a probe (the launch makes one), so a heat map too.
        from vpscluster.monitor.report import write_report
        from vpscluster.probe.store import load_probe

        page = write_report(tmp_path / "mon-run").read_text()
        assert "Compute vs communication per rank" in page and all(n.name in page for n in info.nodes)
        if any(x.get("bandwidth_mbit") for x in (load_probe(cluster) or {}).get("links", [])):
            assert "Measured bandwidth between nodes" in page
    finally:
        down = run_cli("monitor", "down", "--cluster", info.cluster_file, timeout=120)
    assert down.returncode == 0, down.stderr
    assert not pid_alive(rec["prometheus_pid"])
    assert not any(pid_alive(e["pid"]) for e in rec["node_exporters"].values())
