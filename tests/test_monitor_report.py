"""`vpscluster report RUN_DIR` writes one self-contained report.html: it renders in headless
Chromium (Debian's `chromium`) with every chart drawn, no console error and no request leaving
the file. The run is a short real 2-rank local run (its report.html comes from `train` itself)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess

import pytest

# Chromium's own background services (time, updates, accounts, dictionaries), not the page.
BROWSER_SERVICES = re.compile(r"^https?://([\w.-]+\.)?(google\.com|googleapis\.com|gvt1\.com|gstatic\.com)/")


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    from conftest import run_cli

    d = tmp_path_factory.mktemp("mon-report") / "run"
    r = run_cli("train", "--max-steps", "12", "--eval-every", "5", "--threads-per-rank", "1", "--run-dir", str(d), "--json",
                cwd=str(d.parent), timeout=600)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["steps"] == 12 and (d / "report.html").exists()  # train wrote it
    return d


def test_report_is_self_contained_and_lists_the_exporters(run_dir, cli):
    (run_dir / "report.html").unlink()
    r = cli("report", str(run_dir))
    assert r.returncode == 0, r.stderr
    page = (run_dir / "report.html").read_text()
    # plotly's JS is embedded: no script, stylesheet or image loaded from anywhere else
    assert re.findall(r"<(?:script|link|img)\b[^>]*\b(?:src|href)=", page) == []
    assert "Plotly.newPlot" in page
    exporters = json.loads((run_dir / "exporters.json").read_text())["exporters"]
    for e in exporters:
        assert f"{e['address']}:{e['rank_port']}" in page


@pytest.mark.tools
@pytest.mark.skipif(shutil.which("chromium") is None, reason="no chromium (apt install chromium)")
def test_report_renders_offline_in_headless_chromium(run_dir, tmp_path):
    net_log = tmp_path / "net.json"
    r = subprocess.run(
        ["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--virtual-time-budget=8000",
         "--disable-background-networking", "--disable-component-update", "--disable-sync", "--no-first-run",
         "--host-resolver-rules=MAP * ~NOTFOUND", f"--log-net-log={net_log}", "--enable-logging=stderr", "--v=0",
         f"--user-data-dir={tmp_path / 'profile'}", "--dump-dom", (run_dir / "report.html").as_uri()],
        capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    dom = r.stdout
    charts = re.findall(r'<div id="(chart-\d+)" class="plotly-graph-div[^"]*"', dom)
    assert len(charts) >= 4  # loss, throughput, compute vs comm, bytes (+ heat map, plan where known)
    # plotly drew each one: an svg with data traces inside every chart's div
    for chart in charts:
        body = dom[dom.index(f'id="{chart}"'):]
        assert 'class="main-svg"' in body[:20000] and ('class="trace' in body[:200000] or "class='trace" in body[:200000]), chart
    console = [ln for ln in r.stderr.splitlines() if ":CONSOLE" in ln]
    assert console == [], console
    urls = set(re.findall(r'"url":"([^"]+)"', net_log.read_text()))
    leaving = [u for u in urls if not u.startswith(("file:", "data:", "blob:")) and not BROWSER_SERVICES.match(u)]
    assert leaving == [], leaving


def test_a_session_runs_report_counts_samples(tmp_path):
    """A `vpscluster run` session's metrics count samples, not tokens: its throughput chart is in
    samples/s (it failed with KeyError 'tokens' before)."""
    from vpscluster.monitor.report import figures, write_report

    lines = [{"step": s, "loss": 2.0 / s, "step_seconds": 0.5, "compute_seconds": 0.4, "comm_seconds": 0.1,
              "samples": 16, "bytes_sent": 40} for s in range(1, 6)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    (tmp_path / "report.json").write_text(json.dumps({"strategy": "ddp", "world_size": 2, "steps": 5, "per_rank": []}))
    figs = dict(figures(tmp_path)[0])
    trace = figs["Throughput and communication"].data[0]
    assert trace.name.startswith("samples/s") and list(trace.y) == [32.0] * 5
    assert write_report(tmp_path).stat().st_size > 1000
