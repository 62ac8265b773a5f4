"""A stopped run checkpoints first: SIGTERM to the launcher of a 2-rank gloo run makes every rank
stop after the same step k, save a checkpoint there and write its report; `--resume` then ends
with exactly the weights of an uninterrupted run (model and optimizer sha256).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import run_cli

pytestmark = pytest.mark.slow

N = 16
CONFIG = f"lr_decay_steps: {N}\nwarmup_steps: 3\nbatch_size: 4\ncheckpoint_every: 1000\neval_every: 1000\neval_batches: 2\n"


def _steps_logged(run: Path) -> int:
    try:
        lines = (run / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return 0
    return sum(1 for line in lines if '"loss"' in line)


def _launch(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "vpscluster", "train", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})


def test_sigterm_to_launcher_checkpoints_and_resume_equals_uninterrupted(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text(CONFIG)
    common = ["--json", "--config", str(config), "--max-steps", str(N)]
    part = tmp_path / "part"
    full = _launch(*common, "--run-dir", str(tmp_path / "full"))  # the reference, side by side
    stopped = _launch(*common, "--run-dir", str(part))
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and _steps_logged(part) < 3 and stopped.poll() is None:
            time.sleep(0.1)
        assert _steps_logged(part) >= 3, "training did not start"
        stopped.send_signal(signal.SIGTERM)
        _, err = stopped.communicate(timeout=120)
        full_out, full_err = full.communicate(timeout=300)
    finally:
        for p in (full, stopped):
            if p.poll() is None:
                p.kill()
    assert stopped.returncode == 130, err[-3000:]
    assert "Traceback" not in err
    report = json.loads((part / "report.json").read_text())
    k = report["steps"]
    assert report["stopped_by"] == "stop_requested" and 3 <= k < N
    # the stop's checkpoint is complete (manifest) and the launcher said where to continue
    assert (part / "checkpoints" / f"step-{k:08d}" / "manifest.json").exists()
    assert f"checkpoint saved at step {k}" in err and f"--resume {part}" in err, err[-2000:]
    # both ranks stopped after the same step: equal weights
    assert {r["model_sha256"] for r in report["per_rank"]} == {report["model_sha256"]}

    assert full.returncode == 0, full_err[-3000:]
    reference = json.loads(full_out)
    r = run_cli("train", "--json", "--resume", str(part), timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    resumed = json.loads(r.stdout)
    assert resumed["resumed_from_step"] == k and resumed["steps"] == N
    assert resumed["model_sha256"] == reference["model_sha256"]
    assert resumed["optimizer_sha256"] == reference["optimizer_sha256"]


def test_sigkilled_launcher_still_gets_a_checkpoint_from_the_guard(tmp_path):
    """No teardown of its own can run: the node-side guard stops the workers, and they checkpoint first."""
    run = tmp_path / "run"
    proc = _launch("--nodes", "2", "--max-steps", "100000", "--batch-size", "4", "--eval-every", "100000",
                   "--run-dir", str(run))
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and _steps_logged(run) < 3 and proc.poll() is None:
            time.sleep(0.1)
        assert _steps_logged(run) >= 3, "training did not start"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not (run / "report.json").exists():
            time.sleep(0.2)
    finally:
        if proc.poll() is None:
            proc.kill()
    report = json.loads((run / "report.json").read_text())
    k = report["steps"]
    assert report["stopped_by"] == "stop_requested" and k >= 3
    assert (run / "checkpoints" / f"step-{k:08d}" / "manifest.json").exists()
