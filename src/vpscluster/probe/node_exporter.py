"""The node exporter: CPU (quota-aware), memory, network bytes per interface and disk, for Prometheus.

    python -m vpscluster.probe.node_exporter [--port 9471] [--bind ADDR] [--node NAME] [--path DIR]
                                             [--link-capacity-bytes-per-s N]

CPU utilisation is what the node really has. Inside a cgroup with a CPU quota (a container, a
VPS slice, a sandbox node) it is the cgroup's CPU time over the quota, so a busy loop on a node
limited to 0.3 cores reads ~100%, not the ~15% of the host's `/proc/stat` on two cores. Where
no quota limits the process it is the usual figure: busy over all jiffies of `/proc/stat`.

The cgroup's CPU time comes from `cpu.stat` (v2) or `cpuacct.usage` (v1 with cpuacct on the
same hierarchy); a v1 `cpu` hierarchy alone (the sandbox's) keeps no usage, so there it is the
sum of the CPU time of the cgroup's processes, accumulated per process so the counter never
goes backwards when one exits.

Values are read when scraped (no sampling thread); the utilisation gauge covers the time since
the previous scrape (at least `MIN_WINDOW_S`).
"""

from __future__ import annotations

import argparse
import os
import shutil
import time
from dataclasses import dataclass

from vpscluster import telemetry as T

MIN_WINDOW_S = 0.5
_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def _mounts() -> list[tuple[str, str, str, set[str]]]:
    """(mount point, root, fs type, options) of the cgroup file systems this process can reach.

    `ip netns exec` (the sandbox's nodes) mounts a fresh /sys without them; the host's are then
    still reachable through pid 1's root (as root)."""
    for mountinfo, prefix in (("/proc/self/mountinfo", ""), ("/proc/1/mountinfo", "/proc/1/root")):
        out = []
        for line in (_read(mountinfo) or "").splitlines():
            left, _, right = line.partition(" - ")
            lf, rf = left.split(), right.split()
            if len(lf) >= 5 and len(rf) >= 3 and rf[0] in ("cgroup", "cgroup2"):
                out.append((prefix + lf[4], lf[3], rf[0], set(rf[2].split(","))))
        if out and os.path.isdir(out[0][0]):
            return out
    return []


@dataclass
class CpuSource:
    """Where this node's CPU time and capacity come from."""

    quota_cores: float | None  # None: no quota; capacity is the CPUs this process may use
    cgroup_dir: str | None  # the cgroup holding the quota
    usage_file: str | None  # cpu.stat (v2) or cpuacct.usage (v1); None: sum over the processes
    cgroup_path: str | None = None  # this process's cpu cgroup as /proc/PID/cgroup names it


QUOTA_ENV = "VPSC_CPU_QUOTA_CORES"  # the node's CPU share as the launcher's probe found it


def own_cpu_cgroup(proc_cgroup: str = "/proc/self/cgroup") -> str | None:
    """This process's cgroup path in the hierarchy carrying `cpu` (v1) or the unified one (v2)."""
    for line in (_read(proc_cgroup) or "").splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3 and "cpu" in parts[1].split(","):
            return parts[2]
    for line in (_read(proc_cgroup) or "").splitlines():
        if line.startswith("0::"):
            return line[3:]
    return None


def find_cpu_source(proc_cgroup: str = "/proc/self/cgroup", quota_cores: float | None = None) -> CpuSource:
    """The tightest CPU quota up this process's cgroup hierarchy, and where its usage is kept.

    Where the cgroup file system is not visible (`ip netns exec` mounts a /sys without it) but the
    process sits in a cgroup below the root, the quota is `quota_cores` (the launcher passes
    the probe's figure in `VPSC_CPU_QUOTA_CORES`) and the usage is summed over the processes
    of the same cgroup, found through /proc."""
    best: tuple[float, str, str | None] | None = None
    mounts = _mounts()
    if quota_cores is None and os.environ.get(QUOTA_ENV):
        try:
            quota_cores = float(os.environ[QUOTA_ENV]) or None
        except ValueError:
            quota_cores = None
    for line in (_read(proc_cgroup) or "").splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        ctrls = set(controllers.split(",")) if controllers else set()
        if ctrls and "cpu" not in ctrls:
            continue
        for mount, root, fstype, opts in mounts:
            if (fstype == "cgroup2") != (not ctrls) or (ctrls and "cpu" not in opts):
                continue
            rel = path[len(root):] if root != "/" and path.startswith(root) else path
            cur = mount + rel.rstrip("/")
            while cur.startswith(mount):
                quota = _quota_at(cur, fstype)
                if quota is not None and (best is None or quota < best[0]):
                    if fstype == "cgroup2":
                        usage = cur + "/cpu.stat"
                    else:
                        usage = cur + "/cpuacct.usage" if "cpuacct" in opts else None
                    best = (quota, cur, usage)
                if cur == mount:
                    break
                cur = os.path.dirname(cur)
    if best is not None:
        return CpuSource(best[0], best[1], best[2], own_cpu_cgroup(proc_cgroup))
    if quota_cores:
        return CpuSource(quota_cores, None, None, own_cpu_cgroup(proc_cgroup))
    return CpuSource(None, None, None)


def _quota_at(cgroup_dir: str, fstype: str) -> float | None:
    if fstype == "cgroup2":
        text = (_read(cgroup_dir + "/cpu.max") or "").split()
        if len(text) == 2 and text[0] != "max":
            return int(text[0]) / int(text[1])
        return None
    quota, period = _read(cgroup_dir + "/cpu.cfs_quota_us"), _read(cgroup_dir + "/cpu.cfs_period_us")
    try:
        q, p = int(quota or "-1"), int(period or "0")
    except ValueError:
        return None
    return q / p if q > 0 and p > 0 else None


def proc_cpu_seconds(pid: int | str) -> float | None:
    """utime + stime of process `pid` in seconds; None when it is gone."""
    text = _read(f"/proc/{pid}/stat")
    if not text:
        return None
    fields = text.rsplit(")", 1)[1].split()
    # utime, stime: fields 14-15 of stat(5), 11-12 after "(comm)". Not the children's (cutime):
    # a reaped child's time was already counted while it ran.
    return (int(fields[11]) + int(fields[12])) / _CLK_TCK


def _cgroup_pids(cgroup_dir: str | None, cgroup_path: str | None) -> list[str]:
    if cgroup_dir is None:  # no cgroup fs here: every process whose cpu cgroup is ours
        pids = []
        for pid in os.listdir("/proc"):
            if pid.isdigit() and own_cpu_cgroup(f"/proc/{pid}/cgroup") == cgroup_path:
                pids.append(pid)
        return pids
    pids = []
    for root, _dirs, files in os.walk(cgroup_dir):
        if "cgroup.procs" in files:
            pids += (_read(os.path.join(root, "cgroup.procs")) or "").split()
    return pids


class CpuMeter:
    """CPU seconds used (a counter) and utilisation over the capacity since the last reading."""

    def __init__(self, source: CpuSource | None = None) -> None:
        self.source = source or find_cpu_source()
        self._per_pid: dict[str, float] = {}
        self._from_pids = 0.0
        self._last: tuple[float, float] | None = None  # (monotonic time, cpu seconds)
        self.utilization = 0.0
        self._host_last: tuple[int, int] | None = None
        self.cpu_seconds()  # the baseline

    @property
    def capacity_cores(self) -> float:
        if self.source.quota_cores:
            return self.source.quota_cores
        return float(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)

    def cpu_seconds(self) -> float:
        s = self.source
        if s.quota_cores is None:
            busy, _total = _host_jiffies()
            return busy / _CLK_TCK
        if s.usage_file and s.usage_file.endswith("cpu.stat"):
            for line in (_read(s.usage_file) or "").splitlines():
                if line.startswith("usage_usec "):
                    return int(line.split()[1]) / 1e6
        elif s.usage_file:
            text = _read(s.usage_file)
            if text:
                return int(text) / 1e9
        # Per-process sum: a process that exits keeps what it had added.
        now = {}
        for pid in _cgroup_pids(s.cgroup_dir, s.cgroup_path):
            v = proc_cpu_seconds(pid)
            if v is not None:
                now[pid] = v
        for pid, v in now.items():
            self._from_pids += max(0.0, v - self._per_pid.get(pid, 0.0))
        self._per_pid = now
        return self._from_pids

    def read(self) -> tuple[float, float]:
        """(cpu seconds, utilisation 0..1) — utilisation over the window since the last read."""
        t = time.monotonic()
        if self.source.quota_cores is None:  # the host: busy over total jiffies
            busy, total = _host_jiffies()
            if self._host_last and t - self._last[0] >= MIN_WINDOW_S and total > self._host_last[1]:
                self.utilization = (busy - self._host_last[0]) / (total - self._host_last[1])
                self._host_last, self._last = (busy, total), (t, busy / _CLK_TCK)
            elif self._host_last is None:
                self._host_last, self._last = (busy, total), (t, busy / _CLK_TCK)
            return busy / _CLK_TCK, min(1.0, max(0.0, self.utilization))
        used = self.cpu_seconds()
        if self._last is None:
            self._last = (t, used)
        elif t - self._last[0] >= MIN_WINDOW_S:
            self.utilization = (used - self._last[1]) / ((t - self._last[0]) * self.capacity_cores)
            self._last = (t, used)
        return used, min(1.0, max(0.0, self.utilization))


def _host_jiffies() -> tuple[int, int]:
    """(busy, total) jiffies of all CPUs from /proc/stat (idle and iowait are not busy)."""
    first = (_read("/proc/stat") or "cpu 0 0 0 0").splitlines()[0].split()[1:]
    values = [int(x) for x in first[:8]]
    idle = values[3] + (values[4] if len(values) > 4 else 0)
    total = sum(values)
    return total - idle, total


def memory() -> tuple[int, int]:
    """(used, total) bytes: the cgroup's where it has a memory limit, else /proc/meminfo."""
    info = {}
    for line in (_read("/proc/meminfo") or "").splitlines():
        k, _, v = line.partition(":")
        if v.strip():
            info[k] = int(v.split()[0]) * 1024
    total = info.get("MemTotal", 0)
    used = total - info.get("MemAvailable", info.get("MemFree", 0))
    return used, total


def network() -> dict[str, tuple[int, int]]:
    """interface -> (rx bytes, tx bytes), from /proc/net/dev (this network namespace)."""
    out = {}
    for line in (_read("/proc/net/dev") or "").splitlines()[2:]:
        name, _, rest = line.partition(":")
        f = rest.split()
        if len(f) >= 9:
            out[name.strip()] = (int(f[0]), int(f[8]))
    return out


class NodeCollector:
    """A prometheus_client collector reading the node when scraped."""

    def __init__(self, node: str, path: str = ".", link_capacity_bytes_per_s: float | None = None,
                 meter: CpuMeter | None = None) -> None:
        self.node, self.path = node, path
        self.link_capacity = link_capacity_bytes_per_s
        self.meter = meter or CpuMeter()

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        def fam(metric, extra=()):
            cls = CounterMetricFamily if metric.kind == "counter" else GaugeMetricFamily
            return cls(metric.name, metric.help, labels=list(metric.labels))

        used_s, util = self.meter.read()
        lab = [self.node]
        for metric, value in ((T.CPU_UTILIZATION, util), (T.CPU_SECONDS, used_s),
                              (T.CPU_CAPACITY, self.meter.capacity_cores)):
            f = fam(metric)
            f.add_metric(lab, value)
            yield f
        mem_used, mem_total = memory()
        for metric, value in ((T.MEMORY_USED, mem_used), (T.MEMORY_TOTAL, mem_total)):
            f = fam(metric)
            f.add_metric(lab, value)
            yield f
        rx, tx = fam(T.NET_RX), fam(T.NET_TX)
        for name, (r, t) in network().items():
            rx.add_metric(lab + [name], r)
            tx.add_metric(lab + [name], t)
        yield rx
        yield tx
        if self.link_capacity:
            f = fam(T.LINK_CAPACITY)
            f.add_metric(lab, self.link_capacity)
            yield f
        try:
            du = shutil.disk_usage(self.path)
        except OSError:
            return
        for metric, value in ((T.DISK_USED, du.used), (T.DISK_TOTAL, du.total)):
            f = fam(metric)
            f.add_metric(lab, value)
            yield f


def serve(node: str, port: int, bind: str = "127.0.0.1", path: str = ".",
          link_capacity_bytes_per_s: float | None = None, fallback: bool = True) -> tuple[object, int, object]:
    """Start the exporter's HTTP server in a daemon thread: (server, port actually bound, thread;
    its CPU time is what serving costs).

    A taken `port` falls back to a free one when `fallback` (the run lists what it used)."""
    from prometheus_client import CollectorRegistry, start_http_server

    registry = CollectorRegistry(auto_describe=False)
    registry.register(NodeCollector(node, path, link_capacity_bytes_per_s))
    try:
        server, thread = start_http_server(port, addr=bind, registry=registry)
    except OSError:
        if not fallback:
            raise
        server, thread = start_http_server(0, addr=bind, registry=registry)
    return server, server.server_address[1], thread


def main(argv: list[str] | None = None) -> int:
    import socket

    p = argparse.ArgumentParser(prog="python -m vpscluster.probe.node_exporter", description=__doc__.split("\n\n")[0])
    p.add_argument("--port", type=int, default=T.NODE_PORT)
    p.add_argument("--bind", default="127.0.0.1", help="address to listen on (the node's cluster address)")
    p.add_argument("--node", default=socket.gethostname(), help="the node's name in the cluster file")
    p.add_argument("--path", default=".", help="a folder on the disk to report (the workdir)")
    p.add_argument("--link-capacity-bytes-per-s", type=float, default=None)
    p.add_argument("--cpu-quota-cores", type=float, default=None,
                   help="the node's CPU share where its cgroup file system is not visible (the probe's figure)")
    p.add_argument("--fallback", action="store_true", help="serve on a free port when --port is taken (printed)")
    args = p.parse_args(argv)
    if args.cpu_quota_cores:
        os.environ[QUOTA_ENV] = str(args.cpu_quota_cores)
    _server, port, _thread = serve(args.node, args.port, args.bind, args.path, args.link_capacity_bytes_per_s, fallback=args.fallback)
    print(f"node exporter for {args.node} on {args.bind}:{port}", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    raise SystemExit(main())
