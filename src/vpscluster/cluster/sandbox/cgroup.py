"""Per-node CPU share with a cgroup-v1 CFS quota.

A node with `cpu=0.45` may use 9 ms of CPU per 20 ms period, whatever it runs: its sshd lives
in /sys/fs/cgroup/cpu/vpscluster/<sandbox>/<node>, and everything sshd spawns inherits the cgroup.
A node without a share still gets a cgroup (quota -1, unlimited), so `down` can find and kill
every process the node ever started, even those that left its network namespace.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from vpscluster.errors import UserError

CPU_ROOT = Path("/sys/fs/cgroup/cpu")
PARENT_NAME = "vpscluster"
PERIOD_US = 20_000  # short periods: a quota-limited node runs smoothly, not 100 ms on / off
DEFAULT_SHARES = 1024
MAX_SHARES = 262_144


def available() -> bool:
    return (CPU_ROOT / "cpu.cfs_quota_us").exists()


def parent() -> Path:
    """The cgroup all sandboxes live under."""
    return CPU_ROOT / PARENT_NAME


def sandbox_cgroup(sandbox: str) -> Path:
    return parent() / sandbox


def node_cgroup(sandbox: str, node: str) -> Path:
    return sandbox_cgroup(sandbox) / node


def create(sandbox: str, node: str, cpu: float | None, sandbox_nodes: int = 1) -> Path:
    if not available():
        raise UserError(f"sandbox: no cgroup-v1 cpu controller at {CPU_ROOT}; CPU shares need it (mount -t cgroup -o cpu cpu {CPU_ROOT})")
    path = node_cgroup(sandbox, node)
    path.mkdir(parents=True, exist_ok=True)
    # CFS weighs a cgroup like ONE nice-0 task against everything outside it. Without more weight,
    # N busy nodes together would get what one ordinary process gets on a loaded machine; with
    # it, each node competes like a process of its own, as separate machines would not compete.
    _set_shares(path.parent.parent, DEFAULT_SHARES * (os.cpu_count() or 1) * 4)
    _set_shares(path.parent, DEFAULT_SHARES * sandbox_nodes)
    (path / "cpu.cfs_period_us").write_text(str(PERIOD_US))
    (path / "cpu.cfs_quota_us").write_text(str(-1 if cpu is None else max(1000, int(round(cpu * PERIOD_US)))))
    return path


def _set_shares(path: Path, shares: int) -> None:
    (path / "cpu.shares").write_text(str(min(MAX_SHARES, shares)))


def quota(path: Path) -> float | None:
    """The share of one core a cgroup may use, None when unlimited."""
    q = int((path / "cpu.cfs_quota_us").read_text())
    return None if q < 0 else q / int((path / "cpu.cfs_period_us").read_text())


def tasks(path: Path) -> list[int]:
    try:
        return [int(p) for p in (path / "cgroup.procs").read_text().split()]
    except FileNotFoundError:
        return []


def remove_tree(path: Path, timeout_s: float = 5.0) -> None:
    """Kill every task in `path` and below, then remove the cgroups (leaves first)."""
    from vpscluster.cluster.sandbox.netns import kill_pids

    if not path.exists():
        return
    dirs = sorted((p for p in path.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True) + [path]
    deadline = time.monotonic() + timeout_s
    for d in dirs:
        while True:
            pids = tasks(d)
            if pids:
                kill_pids(pids, timeout_s=1.0)
            try:
                os.rmdir(d)
                break
            except FileNotFoundError:
                break
            except OSError as e:  # EBUSY while a killed task is still exiting
                if time.monotonic() > deadline:
                    raise UserError(f"sandbox: cannot remove cgroup {d}: {e.strerror}; tasks left: {tasks(d)}") from None
                time.sleep(0.05)


def remove_parent_if_empty() -> None:
    """The shared /sys/fs/cgroup/cpu/vpscluster goes when the last sandbox does."""
    try:
        os.rmdir(parent())
    except OSError:  # absent, or another sandbox still lives in it
        pass



def set_quota(path: Path, cpu: float | None) -> None:
    """Change a node cgroup's CPU share while it runs (`sandbox set --cpu`); None = unlimited.

    Works on either hierarchy, read from the files the node's cgroup has: cgroup v1
    (cpu.cfs_quota_us, -1 = unlimited) or v2 (cpu.max, "QUOTA PERIOD" or "max PERIOD"). The
    kernel applies a new quota from the next period on: every task already in the cgroup (and
    all it spawns) is held to it within milliseconds, nothing restarts.
    """
    v2, v1 = path / "cpu.max", path / "cpu.cfs_quota_us"
    if v2.exists():
        period = int(v2.read_text().split()[1])
        v2.write_text(f"{'max' if cpu is None else max(1000, int(round(cpu * period)))} {period}")
    elif v1.exists():
        period = int((path / "cpu.cfs_period_us").read_text())
        v1.write_text(str(-1 if cpu is None else max(1000, int(round(cpu * period)))))
    else:
        raise UserError(f"sandbox: no cgroup CPU quota at {path}; is the sandbox up? (`vpscluster sandbox status`)")
