"""`vpscluster monitor up|down|status`: a real Prometheus server on the head, scraping every node
exporter and the current run's ranks.

    up      sends the package to every node (by content hash, as `train` does), starts a node
            exporter on each (NODE_PORT, detached, pid in <workdir>/monitor/node-exporter.pid),
            writes <head workdir>/monitor/{prometheus.yml, targets/nodes.json} and starts the
            Prometheus binary on the head (PROMETHEUS_PORT, retention limited by time and size).
    down    stops Prometheus and the node exporters (SIGTERM, then SIGKILL) and checks they are gone.
    status  whether it runs, where, and the health of every target.

Targets come from file-based service discovery (`targets/*.json`): `train` writes
`targets/run.json` with the exporters its ranks really bound (exporters.json) when the run
starts, and Prometheus picks it up without a restart. The launcher keeps a record of where the
server runs next to the cluster's probe (`<cluster>.monitor.json`), so `top`, the queries and
`train` find it.

Node exporters (`--node-exporter`): `builtin` (the default) is vpscluster's own
(`probe/node_exporter.py`, `vpscluster_node_*` metrics): its CPU figure is usage over the node's
cgroup quota, right in a container or a sandbox node. `debian` runs Debian's
`prometheus-node-exporter` instead (`apt install prometheus-node-exporter`; its service can stay
disabled, vpscluster starts its own on DEBIAN_NODE_PORT with the cpu, meminfo, netdev,
filesystem and loadavg collectors) - the standard `node_*` metrics that existing dashboards
and alerts know; its CPU figure is the machine's /proc/stat, right on a VM but not inside a
container with a CPU quota. `auto`: debian on the nodes where it is installed, builtin
elsewhere. The builtin is not the default even where Debian's is installed, so the quota-aware
figure is what a scheduler reads unless asked otherwise; a training run's own node exporters
are builtin either way. `monitor/query.py` reads both sets of names.

Where they listen: every exporter on its node's cluster address, Prometheus on the head's (the
overlay's once `provision` made one, else the cluster file's host, which `monitor up` accepts only
when private or with --insecure-network): nothing binds every interface, and nothing
unauthenticated faces the internet. Over an overlay this machine is not on the mesh, so `top`,
`report`, `status` and batch's load figures reach Prometheus through an SSH tunnel to the head
(monitor/tunnel.py; the record says `tunnel: true`).

Prometheus itself: Debian/Ubuntu `apt install prometheus` (the package's service can stay
disabled; vpscluster starts its own instance); elsewhere the release tarball from
prometheus.io/download, with `prometheus` on the head's PATH or `--prometheus PATH`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import posixpath
import shlex
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from vpscluster import telemetry as T
from vpscluster.cluster.daemon import DETACHED_WAIT, STOP_PID
from vpscluster.errors import RemoteError, UserError

MONITOR_DIR = "monitor"
RETENTION_TIME = "15d"
RETENTION_SIZE = "1GB"
START_TIMEOUT_S = 30.0


@dataclass
class MonitorRecord:
    """Where the monitoring of a cluster runs (the launcher's record)."""

    head: str
    url: str
    monitor_dir: str  # on the head
    prometheus_pid: int
    scrape_interval_s: float
    node_exporters: dict[str, dict[str, Any]] = field(default_factory=dict)  # node -> {address, port, pid}
    started_at: float = 0.0
    tunnel: bool = False  # `url` is on the head's overlay address: reached from here through SSH

    @contextlib.contextmanager
    def reached(self, cluster) -> Iterator[str]:
        """`url` as this machine reaches it: itself, or an SSH tunnel's local URL while inside."""
        if not self.tunnel:
            yield self.url
            return
        from urllib.parse import urlsplit

        from vpscluster.monitor.tunnel import Tunnel

        where = urlsplit(self.url)
        with Tunnel(cluster, self.head, where.hostname or "", where.port or T.PROMETHEUS_PORT) as t:
            yield f"http://127.0.0.1:{t.port}"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def record_path(cluster) -> Path:
    from vpscluster.probe.store import probe_path

    p = probe_path(cluster)
    return p.with_name(p.name.replace(".probe.json", ".monitor.json"))


def load_record(cluster) -> MonitorRecord | None:
    try:
        return MonitorRecord(**json.loads(record_path(cluster).read_text()))
    except (OSError, ValueError, TypeError):
        return None


def _save_record(cluster, rec: MonitorRecord | None) -> None:
    from vpscluster.probe.store import write_json

    path = record_path(cluster)
    if rec is None:
        path.unlink(missing_ok=True)
    else:
        write_json(path, rec.to_dict())


# --- generated configuration (pure) ---------------------------------------------------------------


def prometheus_config(monitor_dir: str, scrape_interval_s: float) -> str:
    """prometheus.yml: one job reading every target file of `monitor_dir/targets`."""
    interval = f"{max(1, round(scrape_interval_s))}s"
    doc = {
        "global": {"scrape_interval": interval, "scrape_timeout": interval, "evaluation_interval": interval},
        "scrape_configs": [{
            "job_name": "vpscluster",
            "file_sd_configs": [{"files": [posixpath.join(monitor_dir, "targets", "*.json")], "refresh_interval": "30s"}],
        }],
    }
    return json.dumps(doc, indent=2) + "\n"  # JSON is YAML


NODE_EXPORTERS = ("builtin", "debian", "auto")
DEBIAN_BINARIES = ("prometheus-node-exporter", "node_exporter")  # Debian's name, upstream's
DEBIAN_COLLECTORS = ("cpu", "meminfo", "netdev", "filesystem", "loadavg")


def node_targets(exporters: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """file_sd entries of the node exporters: `exporter` is "node" (builtin) or "node-debian"."""
    return [{"targets": [f"{e['address']}:{e['port']}"],
             "labels": {"node": name, "exporter": "node-debian" if e.get("kind") == "debian" else "node"}}
            for name, e in sorted(exporters.items())]


def run_targets(run_id: str, exporters: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The file_sd entries of a run's exporters.json (rank exporters and the run's node exporters)."""
    out = []
    for e in exporters:
        labels = {"node": e["node"], "run": run_id}
        out.append({"targets": [f"{e['address']}:{e['rank_port']}"], "labels": {**labels, "exporter": "rank", "rank": str(e["rank"])}})
        if e.get("node_port"):
            out.append({"targets": [f"{e['address']}:{e['node_port']}"], "labels": {**labels, "exporter": "run-node"}})
    return out


# --- up / down / status ----------------------------------------------------------------------------


def _quiet(_: str) -> None:
    pass


def up(cluster, *, port: int = T.PROMETHEUS_PORT, scrape_interval_s: float = 5.0, prometheus: str = "prometheus",
       say: Callable[[str], None] = _quiet, node_exporter: str = "builtin",
       debian_port: int = T.DEBIAN_NODE_PORT) -> MonitorRecord:
    if node_exporter not in NODE_EXPORTERS:
        raise UserError(f"--node-exporter {node_exporter!r}: choose one of {', '.join(NODE_EXPORTERS)}")
    rec = load_record(cluster)
    if rec is not None and _answers(cluster, rec):
        raise UserError(f"monitoring already runs for this cluster at {rec.url}; `vpscluster monitor down` first")
    if rec is not None:  # recorded but not answering (a node rebooted, Prometheus died): clear what is left
        try:
            down(cluster)
        except Exception as e:
            say(f"note: could not stop what the last `monitor up` left: {e}")
    rec = asyncio.run(_up(cluster, port, scrape_interval_s, prometheus, say, node_exporter, debian_port))
    _save_record(cluster, rec)
    return rec


_DETACHED = DETACHED_WAIT  # cluster/daemon.py (shared with `queue up`)


def _node_exporter_cmd(python: str, node: str, address: str, workdir: str, pythonpath: str | None,
                       quota: float | None, link_capacity: float | None = None) -> str:
    mdir = posixpath.join(workdir, MONITOR_DIR)
    argv = [python, "-m", "vpscluster.probe.node_exporter", "--node", node, "--bind", address, "--path", workdir,
            "--port", str(T.NODE_PORT), "--fallback"]
    if quota:
        argv += ["--cpu-quota-cores", str(quota)]
    if link_capacity:
        argv += ["--link-capacity-bytes-per-s", f"{link_capacity:.0f}"]
    env = f"PYTHONPATH={shlex.quote(pythonpath)} " if pythonpath else ""
    log, pid = shlex.quote(posixpath.join(mdir, "node-exporter.log")), shlex.quote(posixpath.join(mdir, "node-exporter.pid"))
    return (f"mkdir -p {shlex.quote(mdir)} && : > {log} || exit 1; {env}setsid nohup {shlex.join(argv)} > {log} 2>&1 < /dev/null & "
            f"echo $! > {pid}; for i in $(seq 100); do grep -q 'node exporter for' {log} && break; sleep 0.1; done; "
            f"cat {pid}; cat {log}")


def debian_exporter_cmd(binary: str, address: str, port: int, mdir: str) -> str:
    """Start Debian's node exporter detached; print its pid, then its log once it listens."""
    # Loopback too (its default leaves out ^lo$): the local cluster's links are loopback, and the
    # builtin reports it as well; the queries leave it out unless asked.
    argv = [binary, f"--web.listen-address={address}:{port}", "--collector.disable-defaults",
            *(f"--collector.{c}" for c in DEBIAN_COLLECTORS), "--collector.netdev.device-exclude=^$"]
    log, pid = shlex.quote(posixpath.join(mdir, "node-exporter.log")), shlex.quote(posixpath.join(mdir, "node-exporter.pid"))
    return (f"mkdir -p {shlex.quote(mdir)} && : > {log} || exit 1; setsid nohup {shlex.join(argv)} > {log} 2>&1 < /dev/null & "
            f"echo $! > {pid}; for i in $(seq 100); do grep -q 'Listening on' {log} && break; "
            f"kill -0 $(cat {pid}) 2>/dev/null || break; sleep 0.1; done; cat {pid}; cat {log}")


def _which_debian() -> str:
    """A shell line printing the path of Debian's node exporter on a node (nothing if absent)."""
    return " || ".join(f"command -v {b}" for b in DEBIAN_BINARIES) + " || true"


async def _up(cluster, port: int, scrape_interval_s: float, prometheus: str, say,
              node_exporter: str = "builtin", debian_port: int = T.DEBIAN_NODE_PORT) -> MonitorRecord:
    from vpscluster.cluster.inventory import open_executors
    from vpscluster.launch.pipeline import SyncItem, local_side
    from vpscluster.launch.preflight import node_endpoints, resolve_workdirs
    from vpscluster.launch.sync import PACKAGE_ON_NODE, package_dir, sync_dir
    from vpscluster.probe.store import load_probe

    timeout_s = cluster.connect_timeout_s + cluster.command_timeout_s
    from vpscluster.monitor.top import link_capacity

    probe = load_probe(cluster)
    facts = {n["name"]: n for n in (probe or {}).get("nodes", [])}
    capacity = link_capacity(probe)
    # Exporters listen where training traffic goes: the overlay's addresses once `provision` made
    # one (Prometheus on the head scrapes them over the mesh), else the cluster file's hosts.
    endpoints = node_endpoints(cluster)
    async with open_executors(cluster) as executors:
        workdirs = await resolve_workdirs(executors, timeout_s)
        code = SyncItem("code", package_dir(), PACKAGE_ON_NODE)
        root, manifest = local_side(code)

        debian: dict[str, str] = {}  # node -> the binary of Debian's node exporter there
        if node_exporter != "builtin":
            found = await asyncio.gather(*(ex.run(_which_debian(), timeout_s=timeout_s) for ex in executors))
            paths = {ex.node.name: (r.stdout.strip().splitlines() or [""])[0] for ex, r in zip(executors, found)}
            missing = [n for n, path in paths.items() if not path]
            if node_exporter == "debian" and missing:  # before anything is started
                raise UserError(f"--node-exporter debian: no prometheus-node-exporter on {', '.join(missing)}; install it "
                                "(Debian/Ubuntu: apt install prometheus-node-exporter) or use --node-exporter auto")
            debian = {n: path for n, path in paths.items() if path}

        async def start_exporter(ex) -> tuple[str, dict[str, Any]]:
            node, workdir = ex.node, workdirs[ex.node.name]
            address = "127.0.0.1" if node.local else endpoints[node.name].address
            if node.name in debian:
                r = await ex.run(debian_exporter_cmd(debian[node.name], address, debian_port,
                                                     posixpath.join(workdir, MONITOR_DIR)), timeout_s=timeout_s)
                lines = r.stdout.strip().splitlines()
                if not r.ok or not any("Listening on" in ln for ln in lines):
                    raise RemoteError(f"node {node.name}: Debian's node exporter did not start on port "
                                      f"{debian_port} (--debian-port): {(r.stderr or r.stdout).strip()[-300:] or r.error}")
                return node.name, {"address": address, "port": debian_port, "pid": int(lines[0]), "kind": "debian"}
            pythonpath = None
            if not node.local:
                r = await sync_dir(ex, root, posixpath.join(workdir, code.remote_rel), timeout_s=max(timeout_s, 300.0),
                                   manifest=manifest)
                pythonpath = posixpath.dirname(r.remote_path)
            f = facts.get(node.name, {})
            quota = f.get("cpu_share") if f.get("cpu_count") and (f.get("cpu_share") or 1e9) < f["cpu_count"] else None
            r = await ex.run(_node_exporter_cmd(node.python, node.name, address, workdir, pythonpath, quota,
                                                capacity.get(node.name)),
                             timeout_s=timeout_s)
            lines = r.stdout.strip().splitlines()
            served = [ln for ln in lines if ln.startswith("node exporter for")]
            if not r.ok or not served:
                raise RemoteError(f"node {node.name}: the node exporter did not start: "
                                  f"{(r.stderr or r.stdout).strip()[-300:] or r.error}")
            return node.name, {"address": address, "port": int(served[0].rsplit(":", 1)[1]), "pid": int(lines[0]),
                               "kind": "builtin"}

        head = next(ex for ex in executors if ex.node.name == cluster.head)
        r = await head.run(f"command -v {shlex.quote(prometheus)}", timeout_s=timeout_s)
        if not r.ok:  # before anything is started
            raise UserError(f"node {cluster.head}: no `{prometheus}` binary; install it (Debian/Ubuntu: apt install "
                            "prometheus; elsewhere the tarball from prometheus.io/download) or pass --prometheus PATH")
        results = await asyncio.gather(*(start_exporter(ex) for ex in executors), return_exceptions=True)
        exporters = dict(x for x in results if not isinstance(x, BaseException))
        started = MonitorRecord(head=cluster.head, url="", monitor_dir="", prometheus_pid=0,
                                scrape_interval_s=scrape_interval_s, node_exporters=exporters)
        failed = [x for x in results if isinstance(x, BaseException)]
        if failed:  # stop the exporters that did start: a failed `up` leaves nothing running
            await _stop_all(executors, started, timeout_s)
            raise failed[0]
        say("node exporters: " + ", ".join(f"{n} {e['address']}:{e['port']}" + (" (debian)" if e.get("kind") == "debian" else "")
                                           for n, e in exporters.items()))
        try:
            return await _start_prometheus(cluster, head, workdirs, exporters, port, scrape_interval_s, prometheus,
                                           executors, timeout_s, say)
        except BaseException:
            await _stop_all(executors, started, timeout_s)
            raise


async def _start_prometheus(cluster, head, workdirs, exporters, port, scrape_interval_s, prometheus, executors,
                            timeout_s, say) -> MonitorRecord:
    from vpscluster.launch.preflight import resolve_address

    from vpscluster.launch.preflight import node_endpoints

    mdir = posixpath.join(workdirs[cluster.head], MONITOR_DIR)
    # Prometheus listens on the head's cluster address: the overlay's once provisioned, where
    # this machine (`top`, `report`, batch's load figures; not on the mesh) reaches it through
    # an SSH tunnel; else the cluster file's host (private, or accepted with --insecure-network).
    node = next(n for n in cluster.nodes if n.name == cluster.head)
    endpoint = None if node.local else node_endpoints(cluster, resolve=False)[cluster.head]
    tunnel = endpoint is not None and endpoint.via == "overlay"
    address = "127.0.0.1" if node.local else endpoint.address if tunnel else resolve_address(node.host)
    with tempfile.TemporaryDirectory(prefix="vpsc-mon-") as tmp:
        Path(tmp, "prometheus.yml").write_text(prometheus_config(mdir, scrape_interval_s))
        Path(tmp, "nodes.json").write_text(json.dumps(node_targets(exporters), indent=2))
        await head.put(str(Path(tmp, "prometheus.yml")), posixpath.join(mdir, "prometheus.yml"), timeout_s=timeout_s)
        await head.put(str(Path(tmp, "nodes.json")), posixpath.join(mdir, "targets", "nodes.json"), timeout_s=timeout_s)
    argv = [prometheus, f"--config.file={posixpath.join(mdir, 'prometheus.yml')}",
            f"--storage.tsdb.path={posixpath.join(mdir, 'data')}",
            f"--storage.tsdb.retention.time={RETENTION_TIME}", f"--storage.tsdb.retention.size={RETENTION_SIZE}",
            f"--web.listen-address={address}:{port}"]
    log = shlex.quote(posixpath.join(mdir, "prometheus.log"))
    r = await head.run(f"setsid nohup {shlex.join(argv)} > {log} 2>&1 < /dev/null & pid=$!; {_DETACHED}; echo $pid",
                       timeout_s=timeout_s)
    if not r.ok:
        raise RemoteError(f"node {cluster.head}: could not start Prometheus: {r.stderr.strip() or r.error}")
    host = f"[{address}]" if ":" in address else address
    rec = MonitorRecord(head=cluster.head, url=f"http://{host}:{port}", monitor_dir=mdir,
                        prometheus_pid=int(r.stdout.strip().splitlines()[-1]), scrape_interval_s=scrape_interval_s,
                        node_exporters=exporters, started_at=time.time(), tunnel=tunnel)
    listener = await head.forward_local(address, port) if tunnel else None
    here = f"http://127.0.0.1:{listener.get_port()}" if listener is not None else rec.url
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not await asyncio.to_thread(_ready, here):  # a thread: the tunnel needs this loop
            alive = await head.run(f"kill -0 {rec.prometheus_pid}", timeout_s=timeout_s)
            if not alive.ok or time.monotonic() > deadline:
                tail = await head.run(f"tail -n 5 {log}", timeout_s=timeout_s)
                await _stop_all(executors, rec, timeout_s)
                raise RemoteError(f"node {cluster.head}: Prometheus did not come up at {rec.url}: {tail.stdout.strip()[-500:]}")
            await asyncio.sleep(0.3)
    finally:
        if listener is not None:
            listener.close()
    say(f"Prometheus at {rec.url} (data in {mdir}/data, kept {RETENTION_TIME} or {RETENTION_SIZE})")
    return rec


def _answers(cluster, rec: MonitorRecord) -> bool:
    """Whether the recorded Prometheus answers (through its tunnel where it has one)."""
    try:
        with rec.reached(cluster) as url:
            return _ready(url)
    except RemoteError:  # the head cannot be reached: not answering
        return False


def _ready(url: str, timeout_s: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(url + "/-/ready", timeout=timeout_s) as r:
            return r.status == 200
    except OSError:
        return False


_STOP = STOP_PID


async def _stop_all(executors, rec: MonitorRecord, timeout_s: float) -> list[str]:
    left = []

    async def stop(ex, pid: int, pattern: str):
        r = await ex.run(_STOP.format(pid=pid, pattern=shlex.quote(pattern)), timeout_s=timeout_s)
        if not r.ok or "left" in r.stdout:
            left.append(f"{ex.node.name}: {pattern} pid {pid} {r.stdout.strip() or r.error or ''}".strip())

    by_name = {ex.node.name: ex for ex in executors}
    # "node.exporter": vpscluster's node_exporter module and Debian's prometheus-node-exporter
    jobs = [stop(by_name[n], e["pid"], "node.exporter") for n, e in rec.node_exporters.items() if n in by_name]
    if rec.head in by_name:
        jobs.append(stop(by_name[rec.head], rec.prometheus_pid, "prometheus"))
    await asyncio.gather(*jobs)
    return left


def down(cluster, say: Callable[[str], None] = _quiet) -> bool:
    """Stop it all; False when nothing was running."""
    from vpscluster.cluster.inventory import open_executors

    rec = load_record(cluster)
    if rec is None:
        return False

    async def run() -> list[str]:
        async with open_executors(cluster) as executors:
            return await _stop_all(executors, rec, cluster.connect_timeout_s + cluster.command_timeout_s)

    left = asyncio.run(run())
    if left:
        raise RemoteError("monitoring: could not stop " + "; ".join(left))
    _save_record(cluster, None)
    say(f"stopped Prometheus ({rec.url}) and {len(rec.node_exporters)} node exporters")
    return True


def status(cluster) -> dict[str, Any]:
    from vpscluster.monitor.query import Prometheus

    rec = load_record(cluster)
    if rec is None:
        return {"running": False}
    try:
        with rec.reached(cluster) as url:
            if _ready(url):
                return {"running": True, **rec.to_dict(), "targets": Prometheus(url).targets()}
    except RemoteError:  # the head cannot be reached: not answering
        pass
    return {"running": False, "url": rec.url, "note": "recorded but not answering; `monitor down` cleans up"}


# --- the current run's targets ---------------------------------------------------------------------


def publish_run_targets(cluster, run_id: str, exporters: list[dict[str, Any]]) -> str | None:
    """Write the run's targets where Prometheus reads them (if monitoring runs): the path, or None.

    An empty `exporters` clears them (the run ended: its stored series stay in Prometheus)."""
    rec = load_record(cluster)
    if rec is None:
        return None
    return write_targets(cluster, rec, "run.json", run_targets(run_id, exporters))


def write_targets(cluster, rec: "MonitorRecord", name: str, targets: list[dict[str, Any]]) -> str:
    """Put `targets` in `targets/NAME` of the running Prometheus (file discovery), atomically
    (written aside, then renamed); the remote path. Used for the run's ranks and the queue."""
    from vpscluster.cluster.inventory import executor_for

    remote = posixpath.join(rec.monitor_dir, "targets", name)

    async def put() -> None:
        ex = executor_for(cluster.node(rec.head), cluster)
        try:
            with tempfile.TemporaryDirectory(prefix="vpsc-mon-") as tmp:
                local = Path(tmp, name)
                local.write_text(json.dumps(targets, indent=2))
                await ex.put(str(local), remote + ".tmp", timeout_s=30.0)
                r = await ex.run(["mv", remote + ".tmp", remote], timeout_s=30.0)  # atomic for Prometheus
                if not r.ok:
                    raise RemoteError(r.stderr.strip() or r.error)
        finally:
            await ex.close()

    asyncio.run(put())
    return remote
