"""How busy a node is with work that is not this job: cheap samples from /proc and the cgroup.

Runs inside each Dask worker (`sample_load`, called by the client through `Client.run`); before
any worker starts, `CAPACITY_SHELL` asks a node for the same capacity with plain shell tools.

What a node can use: its CPU cgroup's quota when it has one (sandbox nodes, containers: quota /
period cores, e.g. 0.45), else the CPUs this process may run on. What is busy: with a quota,
the CPU time of the processes in the cgroup; without, the whole machine's (/proc/stat). Our
own share is the CPU time of the processes tagged with the job's `VPSC_LAUNCH_ID` (workers and
what they start), so `foreign = busy - ours`: the load that admission acts on. A process we
cannot read (another user's) counts as foreign, which it is.

When the cluster's monitoring runs (`vpscluster monitor up`), how busy a node is comes from its
Prometheus instead (`monitor_busy`: the node exporters' CPU over quota, quota-aware like the
above) and only our own share from the workers; without a monitor, or when it does not answer
within its time-out, the direct samples are used.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

LAUNCH_ID_ENV = "VPSC_LAUNCH_ID"  # the same tag as launch.commands.LAUNCH_ID_ENV (teardown finds it)
_TICK = os.sysconf("SC_CLK_TCK")
_last: dict = {}  # previous sample per process (worker-side state between calls)


def _cpu_cgroup_dir() -> Path | None:
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "cpu" in controllers.split(","):
            for root in ("/sys/fs/cgroup/cpu", "/sys/fs/cgroup/cpu,cpuacct"):
                d = Path(root + path.rstrip("/"))
                if (d / "cpu.cfs_quota_us").exists():
                    return d
        if controllers == "" and (Path("/sys/fs/cgroup" + path) / "cpu.max").exists():  # cgroup v2
            return Path("/sys/fs/cgroup" + path.rstrip("/"))
    return None


def _quota_cores(d: Path) -> float | None:
    try:
        if (d / "cpu.max").exists():
            quota, period = (d / "cpu.max").read_text().split()
            return None if quota == "max" else int(quota) / int(period)
        quota = int((d / "cpu.cfs_quota_us").read_text())
        return None if quota <= 0 else quota / int((d / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None


def capacity() -> dict:
    """{"cores": usable cores (float), "cgroup": dir or None, "slots": whole workers to start}."""
    cpus = len(os.sched_getaffinity(0))
    d = _cpu_cgroup_dir()
    quota = _quota_cores(d) if d else None
    cores = min(cpus, quota) if quota else float(cpus)
    return {"cores": cores, "cpus": cpus, "cgroup": str(d) if quota else None,
            "slots": max(1, int(cores + 0.5))}


def _proc_cpu_s(pid: str) -> float | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2:].split()
    return (int(fields[11]) + int(fields[12])) / _TICK


def _tagged(pid: str, tag: bytes) -> bool:
    try:
        return tag in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return False


def _machine_busy_s() -> float:
    fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    values = [int(v) for v in fields[:8]]
    idle = values[3] + values[4]  # idle + iowait
    return (sum(values) - idle) / _TICK


def sample_load(job_id: str | None = None) -> dict:
    """This node's load since the previous call: fractions of its capacity.

    `foreign` is what admission looks at; None on the first call (nothing to compare with).
    """
    job_id = job_id or os.environ.get(LAUNCH_ID_ENV, "")
    tag = f"{LAUNCH_ID_ENV}={job_id}".encode()
    cap = _last.get("capacity") or capacity()
    now = time.monotonic()
    if cap["cgroup"]:
        try:
            pids = Path(cap["cgroup"], "cgroup.procs").read_text().split()
        except OSError:
            pids = []
    else:
        pids = [p for p in os.listdir("/proc") if p.isdigit()]
    ours_s, all_s = {}, {}
    for pid in pids:
        cpu_s = _proc_cpu_s(pid)
        if cpu_s is None:
            continue
        all_s[pid] = cpu_s
        if job_id and _tagged(pid, tag):
            ours_s[pid] = cpu_s
    busy_s = sum(all_s.values()) if cap["cgroup"] else _machine_busy_s()
    prev = _last.get("sample")
    _last.update(capacity=cap, sample=(now, busy_s, ours_s, all_s))
    out = {"capacity": cap["cores"], "foreign": None, "ours": None}
    if prev is None or now - prev[0] < 0.05:
        return out
    t0, busy0, ours0, all0 = prev
    dt = now - t0
    if cap["cgroup"]:  # per process: a process that ended takes its history with it
        busy = sum(v - all0.get(p, 0.0) for p, v in all_s.items())
    else:
        busy = busy_s - busy0
    ours = sum(v - ours0.get(p, 0.0) for p, v in ours_s.items())
    out["ours"] = round(max(0.0, ours) / dt / cap["cores"], 3)
    out["foreign"] = round(max(0.0, busy - ours) / dt / cap["cores"], 3)
    return out


# A node's capacity asked before any worker runs there, without Python (nodes need no
# vpscluster installed for it): usable CPUs, then the CFS quota and period of the cpu cgroup
# this shell is in (v1), else cgroup v2's cpu.max; `capacity_from_shell` reads the answer.
CAPACITY_SHELL = (
    "nproc; p=$(awk -F: '$2 ~ /(^|,)cpu(,|$)/ {print $3}' /proc/self/cgroup | head -n1); "
    "for d in /sys/fs/cgroup/cpu$p /sys/fs/cgroup/cpu,cpuacct$p; do "
    "[ -r $d/cpu.cfs_quota_us ] && { cat $d/cpu.cfs_quota_us $d/cpu.cfs_period_us; exit 0; }; done; "
    "q=$(awk -F: '$1 == \"0\" {print $3}' /proc/self/cgroup); "
    "[ -r /sys/fs/cgroup$q/cpu.max ] && cat /sys/fs/cgroup$q/cpu.max; exit 0"
)


def capacity_from_shell(stdout: str) -> dict:
    """`capacity()`'s answer from `CAPACITY_SHELL`'s output."""
    words = stdout.split()
    cpus = int(words[0])
    quota = None
    if len(words) >= 3 and words[1] not in ("-1", "max"):
        quota = int(words[1]) / int(words[2])
    cores = min(cpus, quota) if quota else float(cpus)
    return {"cores": cores, "cpus": cpus, "cgroup": "yes" if quota else None, "slots": max(1, int(cores + 0.5))}


MONITOR_WINDOW = "10s"  # two scrapes at the monitor's default 5 s interval


def monitor_busy(cluster, timeout_s: float = 2.0, window: str = MONITOR_WINDOW) -> dict[str, float] | None:
    """Each node's busy share of its CPU (0..1) from the cluster's Prometheus, or None when no
    monitor runs for the cluster, it does not answer, or it has no figure yet (the caller then
    uses the workers' direct samples). Blocking (HTTP): call it off the event loop."""
    from vpscluster.errors import RemoteError, UserError
    from vpscluster.monitor.query import cpu_utilization, prometheus_for

    try:
        with prometheus_for(cluster, timeout_s) as prom:  # over an overlay: an SSH tunnel, closed after
            return cpu_utilization(prom, window) or None
    except (UserError, RemoteError, ValueError, KeyError):
        return None
