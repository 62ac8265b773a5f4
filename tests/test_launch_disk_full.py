"""A node's disk fills during training (`sandbox fault disk-full`): the checkpoints taken while
it is full fail on every rank alike and training goes on; the previous checkpoint is intact,
and once the disk has room again (`clear`) the run checkpoints and finishes normally.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fault_helpers import sandbox_name
from sandbox_fixtures import SandboxFactory

pytestmark = [pytest.mark.sandbox, pytest.mark.slow]


def events(run_dir: Path, kind: str) -> list[dict]:
    found = []
    logs = list((run_dir / "logs").glob("node-*.log")) if (run_dir / "logs").exists() else []
    for p in logs:
        for m in re.finditer(r'(\{"event":"%s".*\})' % kind, p.read_text(errors="replace")):
            try:
                found.append(json.loads(m.group(1)))
            except ValueError:
                pass
    return found


def wait_until(pred, proc, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None and not pred():
        time.sleep(0.3)
    assert pred(), f"launcher: {proc.poll()}"


def test_disk_full_during_checkpoints_keeps_training(tmp_path):
    from vpscluster.cluster.sandbox import faults

    factory = SandboxFactory()
    try:
        info = factory(nodes=2, bandwidth="1gbit", name=sandbox_name())
        run_dir = tmp_path / "run"
        proc = subprocess.Popen(
            [sys.executable, "-m", "vpscluster", "train", "--cluster", info.cluster_file, "--preset", "tiny",
             "--max-steps", "60", "--checkpoint-every", "5", "--eval-every", "1000", "--run-dir", str(run_dir)],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        try:
            wait_until(lambda: events(run_dir, "checkpoint"), proc, 300)
            # The node without rank 0 (rank 0 writes the run's metrics; this one only its shards).
            rank0 = next(n.name for n in info.nodes if re.search(rf" {n.name}/0 ", (run_dir / "logs" / f"{n.name}.log").read_text()))
            victim = next(n for n in info.nodes if n.name != rank0)
            faults.inject(info.name, victim.name, "disk-full")
            wait_until(lambda: events(run_dir, "checkpoint_failed"), proc, 120)
            ckpts = Path(victim.workdir, "runs", run_dir.name, "checkpoints")
            intact = sorted(p.name for p in ckpts.iterdir() if (p / "manifest.json").exists())
            assert intact, "the checkpoint from before the disk filled is gone"
            faults.clear(info.name)
            _, err = proc.communicate(timeout=300)
            assert proc.returncode == 0, err[-2000:]
        finally:
            if proc.poll() is None:
                proc.kill()
            faults.clear(info.name)
        failed = events(run_dir, "checkpoint_failed")
        assert failed and "No space left" in failed[0]["reason"]
        report = json.loads((run_dir / "report.json").read_text())
        assert report["steps"] == 60
        assert any(e["step"] == 60 for e in events(run_dir, "checkpoint"))  # room again: the final one is there
    finally:
        factory.close()
