"""The default thread count follows the CPU the node really grants (cgroup quota included)."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

CPU_CGROUP = Path("/sys/fs/cgroup/cpu")


def _needs_cgroup_v1() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to create a cgroup with a CPU quota")
    if not (CPU_CGROUP / "cpu.cfs_quota_us").exists():
        pytest.skip("needs the cgroup-v1 cpu controller at /sys/fs/cgroup/cpu")


@pytest.mark.tools  # a real cgroup: in CI (VPSC_TESTS_REQUIRE_SANDBOX=1) a skip here fails
@pytest.mark.parametrize("quota_cores, expected", [(0.45, 1), (1.5, 2), (None, None)])
def test_threads_per_rank_respects_quota(quota_cores, expected):
    _needs_cgroup_v1()
    group = CPU_CGROUP / f"vpsc-test-threads-{uuid.uuid4().hex[:8]}"
    group.mkdir()
    try:
        period = int((group / "cpu.cfs_period_us").read_text())
        if quota_cores is not None:
            (group / "cpu.cfs_quota_us").write_text(str(int(quota_cores * period)))
        # The one rule the trainer, local launch and calibration share: one rank alone, nothing configured.
        code = "from vpscluster.train.trainer import threads_per_rank; print(threads_per_rank(0, 1))"
        # The child joins the cgroup before exec, so everything it runs is under the quota.
        out = subprocess.run(
            ["sh", "-c", f'echo $$ > {group}/tasks && exec "{sys.executable}" -c "{code}"'],
            capture_output=True, text=True, timeout=60, check=True,
        ).stdout
        got = int(out.strip())
        if expected is None:
            expected = len(os.sched_getaffinity(0))
        assert got == min(expected, len(os.sched_getaffinity(0)))
    finally:
        for pid in (group / "tasks").read_text().split():
            subprocess.run(["kill", "-9", pid], check=False)
        group.rmdir()


def test_threads_per_rank_shares_the_cpus_and_obeys_the_config():
    from vpscluster.nodeside.facts import available_cpus
    from vpscluster.train.trainer import threads_per_rank

    cpus = available_cpus()
    assert 1 <= cpus <= len(os.sched_getaffinity(0))
    assert threads_per_rank(0, 1) == threads_per_rank(None, 1) == cpus
    assert threads_per_rank(0, 2) == max(1, cpus // 2)
    assert threads_per_rank(0, 10 * cpus) == 1  # never zero threads
    assert threads_per_rank(3, 8) == 3  # the config wins

