"""Debian's prometheus-node-exporter as a node exporter: `monitor up --node-exporter debian`
starts the real binary (not its systemd service) on a port of its own; Prometheus scrapes it
beside vpscluster's builtin exporter, and the load queries give the same-shaped figures from
both (CPU utilization and capacity, memory, bytes/s per interface), all on loopback."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from conftest import free_port, pid_alive, run_cli
from test_monitor_prometheus import wait_for

pytestmark = [pytest.mark.tools, pytest.mark.skipif(
    shutil.which("prometheus") is None or shutil.which("prometheus-node-exporter") is None,
    reason="no prometheus or prometheus-node-exporter binary (apt install prometheus prometheus-node-exporter)")]


def test_debian_and_builtin_exporters_give_the_same_figures(tmp_path, monkeypatch):
    from vpscluster.monitor import query

    monkeypatch.setenv("HOME", str(tmp_path))
    env = {"HOME": str(tmp_path)}
    port, debian_port, builtin_port = free_port(), free_port(), free_port()
    r = run_cli("monitor", "up", "--node-exporter", "debian", "--debian-port", str(debian_port), "--port", str(port),
                "--scrape-interval", "1", "--json", env=env, cwd=str(tmp_path), timeout=120)
    assert r.returncode == 0, r.stderr
    rec = json.loads(r.stdout)
    debian = rec["node_exporters"]["local"]
    # vpscluster's own exporter as a second node, added to the same file-based discovery
    builtin = subprocess.Popen([sys.executable, "-m", "vpscluster.probe.node_exporter", "--node", "builtin-node",
                                "--bind", "127.0.0.1", "--port", str(builtin_port), "--path", str(tmp_path)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        assert debian["kind"] == "debian" and debian["port"] == debian_port and pid_alive(debian["pid"])
        assert "prometheus-node-exporter" in open(f"/proc/{debian['pid']}/cmdline").read()
        (tmp_path / "monitor" / "targets" / "extra.json").write_text(json.dumps(
            [{"targets": [f"127.0.0.1:{builtin_port}"], "labels": {"node": "builtin-node", "exporter": "node"}}]))
        prom = query.Prometheus(rec["url"])
        up = wait_for(lambda: {t["labels"]["exporter"] for t in prom.targets() if t["health"] == "up"} >= {"node", "node-debian"},
                      60, "both exporters scraped")
        assert up
        nodes = {"local", "builtin-node"}

        def of_both(fn):
            return lambda: (lambda got: got if set(got) >= nodes else None)(fn())

        cpu = wait_for(of_both(lambda: query.cpu_utilization(prom)), 60, "CPU of both nodes")
        rates = wait_for(of_both(lambda: query.link_rates(prom, include_loopback=True)), 30, "link rates of both nodes")
        cap, mem = query.cpu_capacity(prom), query.memory(prom)
        for node in nodes:
            assert 0.0 <= cpu[node] <= 1.0
            assert cap[node] >= 0.01
            assert set(mem[node]) == {"used_bytes", "total_bytes"} and 0 < mem[node]["used_bytes"] <= mem[node]["total_bytes"]
            # loopback carries the scrapes themselves: both see traffic on "lo", as tx and rx
            assert set(rates[node]["lo"]) == {"tx", "rx"} and rates[node]["lo"]["rx"] > 0, rates
        # one machine seen by both: the same interfaces (sandboxes of others may come and go), its CPUs
        assert "lo" in set(rates["local"]) & set(rates["builtin-node"])
        assert cap["local"] == pytest.approx(len([ln for ln in open("/proc/stat") if ln[:3] == "cpu" and ln[3].isdigit()]))
        snap_cli = run_cli("top", "--json", env=env, cwd=str(tmp_path), timeout=60)
        assert snap_cli.returncode == 0, snap_cli.stderr
        row = json.loads(snap_cli.stdout)["nodes"][0]
        assert row["node"] == "local" and row["memory_total_bytes"] == pytest.approx(mem["local"]["total_bytes"], rel=0.01)
        assert row["cpu_capacity_cores"] == cap["local"] and row["rx_bytes_per_s"] > 0
    finally:
        builtin.terminate()
        builtin.wait(timeout=10)
        down = run_cli("monitor", "down", env=env, cwd=str(tmp_path), timeout=120)
    assert down.returncode == 0, down.stderr
    assert not pid_alive(debian["pid"]) and not pid_alive(rec["prometheus_pid"])
