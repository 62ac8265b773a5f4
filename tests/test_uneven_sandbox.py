"""Uneven nodes on the sandbox: a node throttled mid-run (`sandbox set --cpu`) gets less work.

Two nodes at half a core train with `--micro-batches 8 --balance`; after a few steps node2's
quota drops to 0.16 core through the CLI, live (a third of its share, as from 0.25 to 0.08: half a
core starts torch and steps twice as fast). Within a few rebalancing looks its share falls
and node1's rises; the report counts the rebalances and metrics.jsonl has the shares per step.
The sandbox is named "[test prefix]ue-...".
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time
from pathlib import Path

import pytest

import sandbox_fixtures

from vpscluster.train.config import StrategyConfig
from vpscluster.train.shares import split_gap

pytestmark = [pytest.mark.sandbox, pytest.mark.slow]


def _quota(cgroup: str) -> float | None:
    """The node's CPU share as the kernel holds it (cgroup v1 or v2)."""
    d = Path(cgroup)
    if (d / "cpu.max").exists():
        q, period = (d / "cpu.max").read_text().split()
        return None if q == "max" else int(q) / int(period)
    q = int((d / "cpu.cfs_quota_us").read_text())
    return None if q < 0 else q / int((d / "cpu.cfs_period_us").read_text())


def _full_weight(cgroup: str) -> None:
    """This sandbox at full weight among sandboxes, so the quotas, not the shared machine's load,
    set the nodes' speeds."""
    parent = Path(cgroup).parent
    if (parent / "cpu.weight").exists():
        (parent / "cpu.weight").write_text("10000")
    else:
        (parent / "cpu.shares").write_text("262144")


def _latest_step(run_dir: Path) -> int:
    logs = list((run_dir / "logs").glob("*.log")) if (run_dir / "logs").exists() else []
    step = 0
    for p in logs:
        for line in p.read_text().splitlines():
            if '"event":"step"' in line.replace(" ", ""):
                step = max(step, json.loads(line.split("VPSC_EVENT ", 1)[1])["step"])
    return step


@pytest.mark.timeout(600)
def test_throttled_node_gets_fewer_micro_batches(make_sandbox, cli, tmp_path):
    # The test suite's sandbox prefix where there is one (teardown and `down --prefix` find it).
    name = f"{getattr(sandbox_fixtures, 'TEST_PREFIX', '')}ue-{secrets.token_hex(3)}"
    info = make_sandbox(nodes=2, bandwidth="1gbit", cpu="0.5,0.5", name=name)
    _full_weight(info.nodes[0].cgroup)
    run_dir = tmp_path / "run"
    throttle_after = 6
    proc = subprocess.Popen(
        [sys.executable, "-m", "vpscluster", "train", "--cluster", info.cluster_file, "--max-steps", "27",
         "--batch-size", "1", "--micro-batches", "8", "--balance", "--rebalance-every", "3", "--eval-every", "1000",
         "--run-dir", str(run_dir), "--json"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        deadline = time.monotonic() + 300
        while proc.poll() is None and _latest_step(run_dir) < throttle_after and time.monotonic() < deadline:
            time.sleep(0.3)
        assert proc.poll() is None, proc.stderr.read()[-3000:]
        r = cli("sandbox", "set", "--name", info.name, "--node", info.nodes[1].name, "--cpu", "0.16", "--json")
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["cpu"] == pytest.approx(0.16)
        assert _quota(info.nodes[1].cgroup) == pytest.approx(0.16)  # live in the kernel's cgroup
        throttled_at = _latest_step(run_dir)
        out, err = proc.communicate(timeout=400)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-3000:]
    report = json.loads(out)
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    shares = {m["step"]: m["shares"] for m in metrics if "shares" in m}
    assert all(sum(s) == 8 for s in shares.values())
    before = shares[throttled_at]
    assert before[1] >= 3, shares  # before the throttle both ran at the same quota: close to even
    # after: node2 (rank 1) has clearly less than before, node1 more
    assert report["shares"][1] < before[1] and report["shares"][1] <= 3, (shares, report["share_history"])
    assert report["rebalances"] >= 1
    assert any(h["step"] > throttled_at and h["to"][1] < h["from"][1] for h in report["share_history"])
    assert report["tokens"] == 27 * 8 * 128  # the global batch never changed
    # the report's split gap is the shares' own figure under the final speed estimates
    assert report["split_gap"] == pytest.approx(split_gap(report["shares"], report["speeds"], StrategyConfig.max_spread), abs=1e-3)
