"""`vpscluster run --detach` for a user's script goes through train's detach path
(`cli/detach.py`, `launch/detached.py`): it returns at once with the launcher running, `attach`
and `logs` read the run, a second launcher is refused, `stop` ends it with the session's
checkpoint, nothing is left running, and the end names `run --resume` to continue."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from conftest import REPO, pid_alive, processes_mentioning, run_cli

SCRIPT = ("--", "python", "examples/image_classifier.py", "--epochs", "100000", "--samples", "512")


@pytest.mark.slow
def test_run_detach_logs_stop(tmp_path):
    run = tmp_path / "run"
    t0 = time.monotonic()
    r = run_cli("run", "--nodes", "2", "--detach", "--json", "--run-dir", str(run), *SCRIPT, cwd=str(REPO), timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads(r.stdout)
    assert doc["run_dir"] == str(run)
    pid = doc["pid"]
    try:
        assert time.monotonic() - t0 < 30 and pid_alive(pid)  # it did not wait for the training
        state = json.loads((run / "launcher.json").read_text())
        argv = state["argv"]  # the script's words stay after `--`, the launcher's flags before
        assert argv[argv.index("--"):] == list(SCRIPT) and "--detached-child" in argv[:argv.index("--")], argv
        metrics = run / "metrics.jsonl"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not (metrics.exists() and metrics.read_text().count('"loss"') >= 3):
            time.sleep(0.2)
        assert metrics.exists() and pid_alive(pid), (run / "logs" / "detached.log").read_text()[-3000:]
        second = run_cli("run", "--nodes", "2", "--resume", str(run), *SCRIPT, cwd=str(REPO), timeout=60)
        assert second.returncode == 2 and f"already has a launcher running (pid {pid} on " in second.stderr, second.stderr
        logs = run_cli("logs", str(run), timeout=60)
        assert logs.returncode == 0 and "local/0" in logs.stdout, logs.stdout[-2000:] + logs.stderr[-2000:]

        s = run_cli("stop", "--json", str(run), timeout=150)
        assert s.returncode == 0, s.stderr
        stopped = json.loads(s.stdout)
        assert stopped["forced"] is False and stopped["exit_status"] not in (None, 0), stopped
        report = json.loads((run / "report.json").read_text())
        k = report["steps"]
        assert report["stopped_by"] == "stop_requested" and k >= 3
        assert len({p["model_sha256"] for p in report["per_rank"]}) == 1
        assert (run / "checkpoints" / f"step-{k:08d}" / "manifest.json").exists()
        assert not pid_alive(pid)
        time.sleep(0.5)
        assert processes_mentioning(str(run)) == []
    finally:
        if pid_alive(pid):
            os.kill(pid, signal.SIGKILL)
    again = run_cli("stop", str(run), timeout=60)
    assert again.returncode != 0 and f"vpscluster run --resume {run} --detach -- python examples/image_classifier.py" \
        in again.stderr, again.stderr
