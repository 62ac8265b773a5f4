"""`train --detach` returns at once and leaves the launcher running; `attach` follows it and
Ctrl-C leaves it running; a second launcher on the run is refused while the first lives; `stop`
ends it with a checkpoint; a dead launcher's leftovers do not block a resume; unknown runs are
one-line errors."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from conftest import pid_alive, processes_mentioning, run_cli


@pytest.mark.slow
def test_detach_attach_stop(tmp_path):
    run = tmp_path / "run"
    t0 = time.monotonic()
    r = run_cli("train", "--detach", "--json", "--nodes", "2", "--max-steps", "100000", "--batch-size", "4",
                "--eval-every", "100000", "--run-dir", str(run), timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads(r.stdout)
    assert doc["run_dir"] == str(run) and doc["run_id"] == "run"
    pid = doc["pid"]
    try:
        assert time.monotonic() - t0 < 60  # it did not wait for the training
        assert pid_alive(pid)
        attach = subprocess.Popen([sys.executable, "-m", "vpscluster", "attach", str(run)], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        deadline = time.monotonic() + 240
        metrics = run / "metrics.jsonl"
        while time.monotonic() < deadline and not (metrics.exists() and metrics.read_text().count('"loss"') >= 3):
            time.sleep(0.2)
        time.sleep(1.5)  # attach polls twice a second
        attach.send_signal(signal.SIGINT)
        out, err = attach.communicate(timeout=30)
        assert attach.returncode == 0, err
        assert "step 0: validation loss" in out and "loss" in out.split("validation loss", 1)[1], out
        assert "detached; the run goes on" in err
        assert pid_alive(pid)  # Ctrl-C on attach left the run alone

        # One launcher per run: a second one (a resume here, a second --detach) is refused in one
        # line naming the live one and the fix, and the first goes on unharmed.
        state = (run / "launcher.json").read_text()
        for extra in ([], ["--detach"]):
            second = run_cli("train", "--resume", str(run), "--nodes", "2", *extra, timeout=120)
            assert second.returncode == 2 and len(second.stderr.strip().splitlines()) == 1, second.stderr[-2000:]
            assert f"already has a launcher running (pid {pid} on " in second.stderr, second.stderr
            assert f"vpscluster stop {run}" in second.stderr and "started" not in second.stdout
        assert (run / "launcher.json").read_text() == state
        steps = metrics.read_text().count('"loss"')
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and metrics.read_text().count('"loss"') <= steps:
            time.sleep(0.2)
        assert pid_alive(pid) and metrics.read_text().count('"loss"') > steps  # still training

        s = run_cli("stop", "--json", str(run), timeout=150)
        assert s.returncode == 0, s.stderr
        stopped = json.loads(s.stdout)
        assert stopped["forced"] is False and stopped["exit_status"] == 130
        report = json.loads((run / "report.json").read_text())
        k = report["steps"]
        assert report["stopped_by"] == "stop_requested" and k >= 3
        assert (run / "checkpoints" / f"step-{k:08d}" / "manifest.json").exists()
        assert f"checkpoint saved at step {k}" in stopped["message"]
        assert not pid_alive(pid)
        time.sleep(0.5)
        assert processes_mentioning(str(run)) == []
    finally:
        if pid_alive(pid):
            os.kill(pid, signal.SIGKILL)

    # a finished run: attach ends at once with its status; stop says it is not running
    a = run_cli("attach", str(run), timeout=60)
    assert a.returncode == 130 and "exit status 130" in a.stderr
    again = run_cli("stop", str(run), timeout=60)
    assert again.returncode == 2 and len(again.stderr.strip().splitlines()) == 1
    assert "is not running" in again.stderr and f"--resume {run}" in again.stderr

    # What a SIGKILLed launcher leaves (launcher.json and the lock file naming a dead pid, no exit
    # status) does not block the next launcher.
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = {"pid": dead.pid, "argv": ["train"], "started": time.time(), "log": str(run / "logs" / "detached.log")}
    (run / "launcher.json").write_text(json.dumps(stale))
    (run / "launcher.lock").write_text(json.dumps({"pid": dead.pid, "host": "here", "started": time.time()}))
    r = run_cli("train", "--resume", str(run), "--max-steps", str(k + 1), "--detach", "--json", timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    resumed = json.loads(r.stdout)["pid"]
    try:
        done = run_cli("attach", str(run), timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        assert json.loads((run / "report.json").read_text())["steps"] == k + 1
    finally:
        if pid_alive(resumed):
            os.kill(resumed, signal.SIGKILL)

    # `logs`: what the nodes printed, by rank, the last lines of each node; following an ended
    # detached run returns at once.
    ranked = run_cli("logs", str(run), "--rank", "0", timeout=60)
    assert ranked.returncode == 0, ranked.stderr
    lines = ranked.stdout.splitlines()
    assert lines and all(re.match(r"^\d\d:\d\d:\d\d \S+/0: ", line) for line in lines), lines[:5]
    assert any('"event":"checkpoint"' in line for line in lines)
    from vpscluster.launch.logs import node_logs

    nodes = node_logs(run / "logs")
    assert list(nodes) == ["local"], nodes
    tail = run_cli("logs", str(run), "--tail", "2", "--follow", timeout=60)
    assert tail.returncode == 0, tail.stderr
    assert 0 < len(tail.stdout.splitlines()) <= 2 * len(nodes) and f"run {run}:" in tail.stderr
    bad = run_cli("logs", str(run), "--node", "nope", timeout=60)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1 and "nope" in bad.stderr, bad.stderr


def test_unknown_runs_are_one_line_errors(tmp_path):
    for cmd in ("attach", "stop", "logs"):
        r = run_cli(cmd, str(tmp_path / "nope"), timeout=60)
        assert r.returncode == 2 and "Traceback" not in r.stderr
        assert len(r.stderr.strip().splitlines()) == 1 and "no run" in r.stderr, r.stderr
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "config.yaml").write_text("preset: tiny\n")
    r = run_cli("stop", str(tmp_path / "plain"), timeout=60)
    assert r.returncode == 2 and "not started with --detach" in r.stderr


def test_detach_checks_the_network_before_it_starts_anything(tmp_path):
    """A launch the network check refuses is refused by `train --detach` itself, in one line,
    before it prints "started" or starts a launcher (it used to say "started", then fail in the
    background)."""
    key = tmp_path / "k"
    key.write_text("x")
    (tmp_path / "c.yaml").write_text(f"defaults: {{identity_file: {key}}}\nnodes:\n  - {{name: a, host: 192.0.2.50}}\n")
    run = tmp_path / "run"
    r = run_cli("train", "--cluster", str(tmp_path / "c.yaml"), "--detach", "--preset", "tiny", "--strategy", "ddp",
                "--run-dir", str(run), timeout=120, cwd=str(tmp_path))
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "refusing to launch over public addresses: a (192.0.2.50)" in lines[0], lines
    assert "started" not in r.stdout and not run.exists()
