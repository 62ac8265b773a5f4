"""The exporter benchmark's arithmetic: the cost in % of tokens/s and the noise floor beside it.
(The benchmark itself runs in a sandbox with a real Prometheus: `vpscluster bench exporters`.)"""

from __future__ import annotations

import pytest

from vpscluster.bench.exporters import ExporterSettings, markdown, monitoring_cpu, quota_sum, run_exporters, summarize
from vpscluster.probe.node_exporter import proc_cpu_seconds
from vpscluster.errors import UserError


def test_cost_and_spread_from_abba_runs():
    rows = [{"run": "01", "exporters": "on", "tokens_per_s": 990.0}, {"run": "02", "exporters": "off", "tokens_per_s": 1000.0},
            {"run": "03", "exporters": "off", "tokens_per_s": 1010.0}, {"run": "04", "exporters": "on", "tokens_per_s": 1000.0},
            {"run": "05", "exporters": "off", "failed": "boom"}]
    sm = summarize(rows)
    assert sm["runs_on"] == 2 and sm["runs_off"] == 2  # the failed run counts on neither side
    assert sm["tokens_per_s_on"] == pytest.approx(995.0) and sm["tokens_per_s_off"] == pytest.approx(1005.0)
    assert sm["cost_pct"] == pytest.approx(100 * 10 / 1005)
    assert sm["spread_on_pct"] == pytest.approx(100 * 10 / 995)
    text = markdown(rows, sm)
    assert "| 05 (failed) | off |" in text and "tokens/s: with exporters 995.0, without 1005.0: cost +1.00%" in text


def test_the_steady_figure_is_summarised_the_same_way():
    rows = [{"exporters": "on", "tokens_per_s": 900.0, "steady_tokens_per_s": 1000.0},
            {"exporters": "off", "tokens_per_s": 1000.0, "steady_tokens_per_s": 1002.0},
            {"exporters": "off", "tokens_per_s": 1000.0, "steady_tokens_per_s": None}]
    sm = summarize(rows, "steady_tokens_per_s")
    assert sm["runs_off"] == 1 and sm["cost_pct"] == pytest.approx(100 * 2 / 1002)
    assert "2nd half: with exporters 1000.0, without 1002.0" in markdown(rows, summarize(rows), sm)


def test_one_side_missing_gives_no_cost():
    assert "cost_pct" not in summarize([{"exporters": "on", "tokens_per_s": 5.0}])


def test_bad_settings_are_refused_before_any_sandbox():
    with pytest.raises(UserError, match="--pairs"):
        run_exporters(ExporterSettings(pairs=0))


def test_monitoring_cpu_is_counted_against_the_quotas():
    assert quota_sum("0.45", 4) == pytest.approx(1.8) and quota_sum("0.6,0.3,0.15", 3) == pytest.approx(1.05)
    report = {"wall_seconds": 100.0, "per_rank": [{"exporter_cpu_seconds": 0.2}, {"exporter_cpu_seconds": 0.1}]}
    # Prometheus used 1.0 s, one exporter 0.5 s, one exporter vanished mid-run (not counted)
    row = monitoring_cpu({1: 10.0, 2: 3.0, 3: 1.0}, {1: 11.0, 2: 3.5, 3: None}, report, quota_cores=1.8)
    assert row["monitor_processes"] == "2/3"
    assert row["servers_cpu_s"] == pytest.approx(1.5) and row["exporters_cpu_s"] == pytest.approx(0.3)
    assert row["monitoring_cpu_pct"] == pytest.approx(100 * 1.8 / 180)
    rows = [{"exporters": "on", "tokens_per_s": 10.0, **row}, {"exporters": "off", "tokens_per_s": 10.0},
            {"exporters": "on", "tokens_per_s": 10.0, "monitoring_cpu_pct": 2.0}]
    sm = summarize(rows)
    assert sm["monitoring_cpu_pct"] == pytest.approx(1.5) and sm["monitoring_cpu_pct_max"] == pytest.approx(2.0)
    assert "monitoring CPU, counted: 1.50% of the nodes' CPU quota on average (at most 2.00% in one run)" in markdown(rows, sm)


def test_process_cpu_is_read_from_proc():
    import os
    import subprocess
    import sys

    busy = proc_cpu_seconds(os.getpid())
    sum(i * i for i in range(2_000_000))
    assert proc_cpu_seconds(os.getpid()) > busy >= 0
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    assert proc_cpu_seconds(p.pid) is None  # gone
