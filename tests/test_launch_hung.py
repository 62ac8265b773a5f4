"""A SIGSTOPped worker is detected by time-out, not waited on forever, and its node is named.

Training on a 2-node sandbox with a 10 s collective time-out; `sandbox fault stop` freezes every
process of node-2 (sshd spared): node-1's collective times out, the launcher finds node-2's
processes in state T and fails with one line naming node-2, long before the stop would end.
Recovery is turned off (`--max-restarts 0`): this test is about the detection and the line.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from fault_helpers import sandbox_name
from sandbox_fixtures import SandboxFactory

pytestmark = [pytest.mark.sandbox, pytest.mark.slow]

COLLECTIVE_TIMEOUT_S = 10


def test_stopped_node_is_named_after_the_collective_timeout(tmp_path):
    from vpscluster.cluster.sandbox import faults

    factory = SandboxFactory()
    try:
        info = factory(nodes=2, bandwidth="1gbit", name=sandbox_name())
        config = tmp_path / "train.yaml"
        config.write_text(f"timeouts:\n  train_collective_s: {COLLECTIVE_TIMEOUT_S}\n")
        run_dir = tmp_path / "run"
        proc = subprocess.Popen(
            [sys.executable, "-m", "vpscluster", "train", "--cluster", info.cluster_file, "--config", str(config),
             "--preset", "tiny", "--max-steps", "100000", "--run-dir", str(run_dir),
             "--max-restarts", "0"],  # the detection itself: recovery (on by default) would relaunch without node-2
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        try:
            deadline = time.monotonic() + 240
            while time.monotonic() < deadline and proc.poll() is None:
                logs = list((run_dir / "logs").glob("node-*.log")) if (run_dir / "logs").exists() else []
                if any('"event":"step"' in p.read_text(errors="replace") for p in logs):
                    break
                time.sleep(0.5)
            assert proc.poll() is None, proc.stderr.read()[-2000:]
            stopped_at = time.monotonic()
            faults.inject(info.name, "node-2", "stop", seconds=300)
            _, err = proc.communicate(timeout=COLLECTIVE_TIMEOUT_S + 120)
            took = time.monotonic() - stopped_at
            last = err.strip().splitlines()[-1]
            assert proc.returncode != 0
            assert "node node-2 hangs" in last and "stopped" in last, last
            assert took < COLLECTIVE_TIMEOUT_S + 90, took  # detected by the time-out, not after the 300 s stop
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
                proc.wait(timeout=30)
            faults.clear(info.name)
    finally:
        factory.close()
