"""Per-node CPU share with a cgroup CPU quota: cgroup v1 (`cpu.cfs_quota_us`) or v2 (`cpu.max`).

A node with `cpu=0.45` may use 9 ms of CPU per 20 ms period, whatever it runs: its sshd lives
in <root>/vpscluster/<sandbox>/<node>, and everything sshd spawns inherits the cgroup.
A node without a share still gets a cgroup (no quota), so `down` can find and kill every
process the node ever started, even those that left its network namespace.

Which hierarchy holds the cpu controller is read from /proc/self/mountinfo:

    v1   a `cgroup` mount whose options name `cpu` (e.g. /sys/fs/cgroup/cpu); quota and period in
         cpu.cfs_quota_us / cpu.cfs_period_us (-1: unlimited), weight in cpu.shares
    v2   the unified `cgroup2` mount (e.g. /sys/fs/cgroup) whose cgroup.controllers offers `cpu`;
         "QUOTA PERIOD" or "max PERIOD" in cpu.max, weight in cpu.weight, and `+cpu` written to
         each ancestor's cgroup.subtree_control so the node cgroups get the controller

On a hybrid host (v1 controllers plus an empty cgroup2 at /sys/fs/cgroup/unified) the v1 cpu
controller is the one in use, so v1 wins. `Hierarchy(version, root)` is the whole interface
below the module functions, so tests drive the v2 path against a fake tree in a temp folder.
"""

from __future__ import annotations

import errno
import os
import time
from dataclasses import dataclass
from pathlib import Path

from vpscluster.errors import UserError

MOUNTINFO = Path("/proc/self/mountinfo")
PARENT_NAME = "vpscluster"
PERIOD_US = 20_000  # short periods: a quota-limited node runs smoothly, not 100 ms on / off
MIN_QUOTA_US = 1000  # the kernel allows no quota under 1 ms per period
DEFAULT_SHARES = 1024  # v1 cpu.shares of a nice-0 task; v2's cpu.weight default is 100
MAX_SHARES = 262_144
MAX_WEIGHT = 10_000


@dataclass(frozen=True)
class Hierarchy:
    """The cgroup hierarchy that holds the cpu controller: "v1" or "v2", and its mount point."""

    version: str
    root: Path

    @property
    def parent(self) -> Path:
        """The cgroup all sandboxes live under (PARENT_NAME read when used: tests move it)."""
        return self.root / PARENT_NAME

    def describe(self) -> str:
        files = "cpu.cfs_quota_us" if self.version == "v1" else "cpu.max"
        return f"cgroup {self.version} ({files} under {self.parent})"

    def create(self, sandbox: str, node: str, cpu: float | None, sandbox_nodes: int = 1) -> Path:
        path = self.parent / sandbox / node
        if self.version == "v2":
            # A v2 cgroup gets a controller only when its parent lists it in subtree_control.
            for level in (self.root, self.parent, self.parent / sandbox):
                level.mkdir(exist_ok=True)
                _enable_cpu(level)
        path.mkdir(parents=True, exist_ok=True)
        # CFS weighs a cgroup like ONE nice-0 task against everything outside it. Without more
        # weight, N busy nodes together would get what one ordinary process gets on a loaded
        # machine; with it, each node competes like a process of its own, as separate machines
        # would not compete.
        self._set_weight(path.parent.parent, DEFAULT_SHARES * (os.cpu_count() or 1) * 4)
        self._set_weight(path.parent, DEFAULT_SHARES * sandbox_nodes)
        q = None if cpu is None else max(MIN_QUOTA_US, int(round(cpu * PERIOD_US)))
        if self.version == "v1":
            _write(path / "cpu.cfs_period_us", str(PERIOD_US))
            _write(path / "cpu.cfs_quota_us", str(-1 if q is None else q))
        else:
            _write(path / "cpu.max", f"{'max' if q is None else q} {PERIOD_US}")
        return path

    def _set_weight(self, path: Path, shares: int) -> None:
        if self.version == "v1":
            _write(path / "cpu.shares", str(min(MAX_SHARES, shares)))
        else:  # the same ratio to the default: cpu.shares 1024 is cpu.weight 100
            _write(path / "cpu.weight", str(max(1, min(MAX_WEIGHT, round(shares * 100 / DEFAULT_SHARES)))))

    def quota(self, path: Path) -> float | None:
        """The share of one core a cgroup may use, None when unlimited."""
        if self.version == "v1":
            q = int((path / "cpu.cfs_quota_us").read_text())
            return None if q < 0 else q / int((path / "cpu.cfs_period_us").read_text())
        q, period = (path / "cpu.max").read_text().split()
        return None if q == "max" else int(q) / int(period)


def _write(path: Path, value: str) -> None:
    try:
        path.write_text(value)
    except OSError as e:
        raise UserError(f"sandbox: cannot write {value!r} to {path}: {e.strerror}; the sandbox limits CPU through it "
                        "(run as root on a host whose cgroup file system is writable)") from None


def _enable_cpu(level: Path) -> None:
    control = level / "cgroup.subtree_control"
    try:
        if "cpu" in control.read_text().replace("+", " ").split():
            return
    except OSError:  # unreadable: the write below says what is wrong
        pass
    try:
        control.write_text("+cpu")
    except OSError as e:
        hint = ("processes live in that cgroup itself, and cgroup v2 gives controllers only to cgroups without "
                "processes of their own; move them to a child cgroup" if e.errno == errno.EBUSY else
                "is the cpu controller offered there (cgroup.controllers) and the file system writable?")
        raise UserError(f"sandbox: cannot enable the cpu controller in {control}: {e.strerror}; {hint}") from None


# --- which hierarchy ----------------------------------------------------------------------------

def _mounts(mountinfo: str) -> list[tuple[str, str, set[str], set[str]]]:
    """(mount point, fs type, mount options, super options) of every cgroup mount."""
    out = []
    for line in mountinfo.splitlines():
        left, sep, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if not sep or len(fields) < 6 or len(tail) < 3 or tail[0] not in ("cgroup", "cgroup2"):
            continue
        point = fields[4].replace("\\040", " ")
        out.append((point, tail[0], set(fields[5].split(",")), set(tail[2].split(","))))
    return out


def detect(mountinfo: str | None = None) -> tuple[Hierarchy | None, str]:
    """The hierarchy holding the cpu controller and writable, or None and why not (one phrase)."""
    if mountinfo is None:
        try:
            mountinfo = MOUNTINFO.read_text()
        except OSError as e:
            return None, f"cannot read {MOUNTINFO}: {e.strerror}"
    mounts = _mounts(mountinfo)
    for point, fstype, opts, sopts in mounts:
        if fstype == "cgroup" and "cpu" in sopts:
            return _writable(Hierarchy("v1", Path(point)), opts)
    v2 = [(point, opts) for point, fstype, opts, _ in mounts if fstype == "cgroup2"]
    for point, opts in v2:
        try:
            offered = (Path(point) / "cgroup.controllers").read_text().split()
        except OSError:
            continue
        if "cpu" in offered:
            return _writable(Hierarchy("v2", Path(point)), opts)
    if v2:
        return None, (f"the cgroup v2 hierarchy at {v2[0][0]} does not offer the cpu controller (cgroup.controllers) "
                      "and no cgroup v1 hierarchy has it")
    return None, "no cgroup v1 hierarchy with the cpu controller and no cgroup v2 hierarchy is mounted"


def _writable(h: Hierarchy, opts: set[str]) -> tuple[Hierarchy | None, str]:
    if "ro" in opts or not os.access(h.root, os.W_OK):
        return None, f"the cgroup {h.version} hierarchy at {h.root} is not writable here (mounted read-only, as in most containers)"
    return h, ""


_current: tuple[Hierarchy | None, str] | None = None


def current() -> Hierarchy | None:
    """This machine's hierarchy (read once per process), None when no cpu controller is usable."""
    global _current
    if _current is None:
        _current = detect()
    return _current[0]


def unavailable_reason() -> str | None:
    """Why the sandbox cannot limit CPU here (one phrase), or None."""
    current()
    return _current[1] if _current[0] is None else None


def available() -> bool:
    return current() is not None


def require() -> Hierarchy:
    h = current()
    if h is None:
        raise UserError(f"sandbox: cannot limit CPU: {unavailable_reason()}; mount one (mount -t cgroup2 none /sys/fs/cgroup, "
                        "or mount -t cgroup -o cpu cpu /sys/fs/cgroup/cpu) or run where cgroups are writable")
    return h


# --- the sandbox's cgroups ----------------------------------------------------------------------

def parent() -> Path | None:
    """The cgroup all sandboxes live under (None where no hierarchy is usable)."""
    h = current()
    return h.parent if h else None


def sandbox_cgroup(sandbox: str) -> Path | None:
    p = parent()
    return p / sandbox if p else None


def node_cgroup(sandbox: str, node: str) -> Path:
    return require().parent / sandbox / node


def enter_argv(cgroup: str | os.PathLike, namespace: str, argv) -> list[str]:
    """`argv` run as a sandbox node's process: moved into its CPU cgroup first (a shell writes its
    own pid, then execs), inside its network namespace."""
    return ["sh", "-c", 'echo $$ > "$0" && exec "$@"', os.path.join(cgroup, "cgroup.procs"),
            "ip", "netns", "exec", namespace, *argv]


def create(sandbox: str, node: str, cpu: float | None, sandbox_nodes: int = 1) -> Path:
    return require().create(sandbox, node, cpu, sandbox_nodes)


def quota(path: Path) -> float | None:
    """The share of one core a cgroup may use, None when unlimited."""
    return require().quota(path)


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
    """The shared <root>/vpscluster goes when the last sandbox does."""
    p = parent()
    if p is None:
        return
    try:
        os.rmdir(p)
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
