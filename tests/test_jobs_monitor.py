"""Batch admission reads node load from the cluster's Prometheus when `monitor up` runs (the real
Debian binary and the node exporter on the local cluster), less the job's own share."""

from __future__ import annotations

import json
import shutil
import time

import pytest

from conftest import free_port, run_cli

pytestmark = [pytest.mark.tools, pytest.mark.skipif(shutil.which("prometheus") is None, reason="no prometheus binary (apt install prometheus)")]


def test_admission_load_comes_from_prometheus_when_the_monitor_runs(tmp_path, monkeypatch):
    from vpscluster.cluster.inventory import local_cluster
    from vpscluster.jobs.load import monitor_busy
    from vpscluster.jobs.run import BatchSpec, run_batch

    monkeypatch.setenv("HOME", str(tmp_path))  # the monitor record lives under ~/.cache
    monkeypatch.chdir(tmp_path)  # the local cluster's workdir: monitor/ goes here
    env = {"HOME": str(tmp_path)}
    (tmp_path / "fns.py").write_text("import time\n\ndef slow(rows):\n    time.sleep(0.2)\n    return rows\n")
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"id": i}) + "\n" for i in range(20)))
    r = run_cli("monitor", "up", "--port", str(free_port()), "--scrape-interval", "1", "--json", env=env,
                cwd=str(tmp_path), timeout=120)
    assert r.returncode == 0, r.stderr
    try:
        cluster = local_cluster()
        deadline = time.monotonic() + 60
        busy = None
        while busy is None and time.monotonic() < deadline:
            busy = monitor_busy(cluster)
            time.sleep(0.5)
        assert busy is not None and set(busy) == {"local"} and 0.0 <= busy["local"] <= 1.0, busy
        res = run_batch(BatchSpec(fn="fns:slow", input=str(tmp_path / "in.jsonl"), output=str(tmp_path / "out"),
                                  partition_rows=2, code_dir=str(tmp_path), load_interval_s=0.5), cluster)
        assert res.ok, res.error
        assert res.load_source == "prometheus"
        assert res.partitions_done == 10
    finally:
        down = run_cli("monitor", "down", env=env, cwd=str(tmp_path), timeout=120)
    assert down.returncode == 0, down.stderr
