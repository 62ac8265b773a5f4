"""A node's disk fills during training (`sandbox fault disk-full`): the checkpoints taken while
it is full fail on every rank alike and training goes on; the previous checkpoint is intact,
and once the disk has room again (`clear`) the run checkpoints and finishes normally. On rank 0's
node (its log, metrics and report live there) the lines that find the disk full are dropped and
counted (`log_lines_dropped` in the report) and the training goes on as well. One sandbox serves
the module.
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
from sandbox_fixtures import SandboxFactory, node_run_dir

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
    assert pred(), f"launcher: {proc.poll()}" + (f": {proc.stderr.read()[-3000:]}" if proc.poll() is not None else "")


def wait_files_settled(folder: Path, proc, quiet_s: float, timeout_s: float) -> None:
    """Until rank 0's metrics and its ranks' logs under `folder` have not grown for `quiet_s`
    (while the launcher still runs; failed checkpoints come and go and are not watched)."""
    def sizes() -> dict[str, int]:
        files = [folder / "metrics.jsonl", *sorted((folder / "logs").glob("rank-*.log"))]
        return {str(p): p.stat().st_size for p in files if p.exists()}

    deadline = time.monotonic() + timeout_s
    last, since = sizes(), time.monotonic()
    while time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.5)
        now = sizes()
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            return
    raise AssertionError(f"{folder}: files still growing after {timeout_s} s, or the launcher ended ({proc.poll()})")


@pytest.fixture(scope="module")
def sandbox2():
    """One 2-node sandbox for the module's tests (each clears its faults when done)."""
    factory = SandboxFactory()
    try:
        yield factory(nodes=2, bandwidth="1gbit", name=sandbox_name())
    finally:
        factory.close()


def rank0_node(info, run_dir: Path) -> str:
    return next(n.name for n in info.nodes if re.search(rf" {n.name}/0 ", (run_dir / "logs" / f"{n.name}.log").read_text()))


def test_disk_full_during_checkpoints_keeps_training(tmp_path, sandbox2):
    from vpscluster.cluster.sandbox import faults

    info = sandbox2
    run_dir = tmp_path / "run"
    # 30 steps: the disk fills right after the first checkpoint (step 5), the next one (step 10
    # here) fails and the fault is cleared at once; the rest leaves the final checkpoint a margin.
    proc = subprocess.Popen(
        [sys.executable, "-m", "vpscluster", "train", "--cluster", info.cluster_file, "--preset", "tiny",
         "--max-steps", "30", "--checkpoint-every", "5", "--eval-every", "1000", "--run-dir", str(run_dir)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        wait_until(lambda: events(run_dir, "checkpoint"), proc, 300)
        # The node without rank 0 (rank 0 writes the run's metrics; this one only its shards).
        rank0 = rank0_node(info, run_dir)
        victim = next(n for n in info.nodes if n.name != rank0)
        faults.inject(info.name, victim.name, "disk-full")
        wait_until(lambda: events(run_dir, "checkpoint_failed"), proc, 120)
        ckpts = node_run_dir(victim, run_dir) / "checkpoints"
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
    assert report["steps"] == 30
    assert any(e["step"] == 30 for e in events(run_dir, "checkpoint"))  # room again: the final one is there


def test_disk_full_on_rank0s_node_keeps_training(tmp_path, sandbox2):
    # Rank 0 writes the run's metrics, its log (every printed line, the "training goes on"
    # warning too) and report.json on its node: with that disk full, what cannot be written is
    # dropped and counted, and the training finishes.
    from vpscluster.cluster.sandbox import faults

    info = sandbox2
    run_dir = tmp_path / "run-rank0-full"  # its own folder on the nodes (runs/<name>-<run_uid>)
    proc = subprocess.Popen(
        [sys.executable, "-m", "vpscluster", "train", "--cluster", info.cluster_file, "--preset", "tiny",
         "--max-steps", "120", "--checkpoint-every", "5", "--eval-every", "1000", "--run-dir", str(run_dir)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        wait_until(lambda: events(run_dir, "checkpoint"), proc, 300)
        victim = next(n for n in info.nodes if n.name == rank0_node(info, run_dir))
        faults.inject(info.name, victim.name, "disk-full")
        wait_until(lambda: events(run_dir, "checkpoint_failed"), proc, 120)
        # The rank lived through the full disk (the old tee raised ENOSPC on the warning line).
        # Its output reaches the launcher through torchelastic's log files on that same disk, so
        # nothing more is seen until there is room. A few more steps on the full disk (each
        # writes a metrics line there, dropped and counted), then clear it: the run must finish.
        # A tmpfs "full" still takes appends into the last page a file already holds, so the
        # first few lines after the fill are written: wait until rank 0's files stop growing
        # (the page is used up and lines are being dropped), not a fixed time a loaded machine
        # may not fill.
        wait_files_settled(node_run_dir(victim, run_dir), proc, quiet_s=6, timeout_s=180)
        assert proc.poll() is None, proc.stderr.read()[-3000:]
        faults.clear(info.name)
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()
        faults.clear(info.name)
    report = json.loads((run_dir / "report.json").read_text())
    assert report["steps"] == 120
    assert report["log_lines_dropped"] > 0, report
    rank0 = next(r for r in report["per_rank"] if r["rank"] == 0)
    assert rank0["log_lines_dropped"] > 0, report["per_rank"]
    node_log = (run_dir / "logs" / f"{victim.name}.log").read_text(errors="replace")
    assert "lines are dropped while the disk is full" in node_log  # the one warning, on the real stderr
