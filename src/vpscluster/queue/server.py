"""`vpscluster queue up|down|status`: a NATS JetStream server on the head, started like Prometheus.

    up      checks the network (public addresses without the overlay are refused, as for every
            service: cluster/netsafety.py), writes <head workdir>/queue/nats.conf (mode 0600, in a
            0700 folder) and starts Debian's `nats-server` on the head, bound to the head's
            cluster address (the overlay's once `provision` made one; loopback on the local
            cluster), never 0.0.0.0; clients must give the token. Streams are stored under
            <head workdir>/queue/store (JetStream's store_dir), at most MAX_STORE in all. Beside it,
            on the same address, nats-server's monitoring port (read-only counts) and the queue's
            Prometheus exporter (nodeside/queue_exporter.py); when `monitor up` runs, its
            Prometheus scrapes the exporter (targets/queue.json).
    down    stops both (SIGTERM: nats-server flushes its store), keeps the streams on disk (and
            the token, so clients keep working after the next `up`); `--purge` removes both.
    status  whether it runs, where, its streams with their message counts, and each consumer's lag.

The token is generated once (secrets.token_urlsafe) and kept on this machine in
`<cluster>.queue.token` (0600, next to the cluster's probe and monitor record) and on the head
only inside nats.conf; processes get it from `Credentials.env()` (VPSC_QUEUE_URL, VPSC_QUEUE_TOKEN).
The launcher's record of where the server runs is `<cluster>.queue.json` (no secret in it).

A server of the user's own instead: the cluster file's `queue: {url: nats://HOST:4222, token_file:
FILE}` (or `user:` + `password_file:`). Then `queue up`/`down` refuse (nothing of ours to start or
stop), `status` and `connect()` use it; a public host is refused unless the URL is `tls://`, the
cluster has an overlay, or `insecure_network: true`.

nats-server: Debian/Ubuntu `apt install nats-server` (the package's service can stay disabled;
vpscluster starts its own instance), elsewhere the release binary on the head's PATH or `--nats-server PATH`.
"""

from __future__ import annotations

import asyncio
import json
import os
import posixpath
import secrets
import shlex
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

from vpscluster import procutil
from vpscluster import telemetry as T
from vpscluster.errors import RemoteError, UserError

QUEUE_DIR = "queue"
MAX_STORE = 1 << 30  # JetStream's file store, all streams together (each stream has its own limits too)
MAX_MEMORY = 64 << 20
MAX_PAYLOAD = 8 << 20  # one message (an intermediate batch of activations)
START_TIMEOUT_S = 30.0
EXPORTER_TAG = "vpsc-queue-exporter"
NATS = "NATS's client port (token-authenticated but unencrypted)"


@dataclass
class QueueRecord:
    """Where the queue of a cluster runs (the launcher's record; no secret in it)."""

    head: str
    url: str  # nats://ADDRESS:PORT
    address: str
    port: int
    monitor_url: str  # nats-server's monitoring (http)
    metrics_url: str  # the exporter's /metrics
    queue_dir: str  # on the head
    nats_pid: int
    exporter_pid: int
    started_at: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "store_dir": self.store_dir}

    @property
    def store_dir(self) -> str:
        return posixpath.join(self.queue_dir, "store")


def _sibling(cluster, suffix: str) -> Path:
    from vpscluster.probe.store import probe_path

    p = probe_path(cluster)
    return p.with_name(p.name.replace(".probe.json", suffix))


def record_path(cluster) -> Path:
    return _sibling(cluster, ".queue.json")


def token_path(cluster) -> Path:
    return _sibling(cluster, ".queue.token")


def load_record(cluster) -> QueueRecord | None:
    try:
        doc = json.loads(record_path(cluster).read_text())
        doc.pop("store_dir", None)  # derived
        return QueueRecord(**doc)
    except (OSError, ValueError, TypeError):
        return None


def _save_record(cluster, rec: QueueRecord | None) -> None:
    from vpscluster.probe.store import write_json

    if rec is None:
        record_path(cluster).unlink(missing_ok=True)
    else:
        write_json(record_path(cluster), rec.to_dict())


def _token(cluster) -> str:
    """The cluster's token: the one kept here (0600), else a new one written so."""
    path = token_path(cluster)
    try:
        token = path.read_text().strip()
        if token:
            os.chmod(path, 0o600)
            return token
    except OSError:
        pass
    token = secrets.token_urlsafe(32)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    os.replace(tmp, path)
    return token


# --- generated configuration (pure) ---------------------------------------------------------------


def nats_config(address: str, port: int, monitor_port: int, queue_dir: str, token: str,
                max_store: int = MAX_STORE, max_memory: int = MAX_MEMORY) -> dict[str, Any]:
    """nats-server's configuration (its format reads JSON): one address for clients and monitoring."""
    import ipaddress

    if ipaddress.ip_address(address.split("%", 1)[0]).is_unspecified:
        raise UserError(f"queue: refusing to bind {address} (every interface); bind the cluster's or overlay's address")
    return {
        "server_name": "vpscluster-queue",
        "host": address,
        "port": port,
        "http": f"{_hostport(address, monitor_port)}",
        "authorization": {"token": token},
        "max_payload": MAX_PAYLOAD,
        "jetstream": {"store_dir": posixpath.join(queue_dir, "store"), "max_file_store": int(max_store),
                      "max_memory_store": int(max_memory)},
        "pid_file": posixpath.join(queue_dir, "nats.pid"),
    }


def _hostport(address: str, port: int) -> str:
    return f"[{address}]:{port}" if ":" in address else f"{address}:{port}"


# --- credentials for clients ----------------------------------------------------------------------


def _check_user_server(cluster) -> None:
    """A user's server on a public host: refused unless TLS, the overlay, or insecure_network."""
    from urllib.parse import urlsplit

    from vpscluster.cluster import netsafety, overlay

    u = urlsplit(cluster.queue.url)
    if u.scheme == "tls" or getattr(cluster, "insecure_network", False) or overlay.load(cluster) is not None:
        return
    if any(netsafety.classify(a) == "public" for a in netsafety.resolve(u.hostname)):
        raise UserError(f"queue: refusing {cluster.queue.url}: a public address, and {NATS}; use a tls:// URL, "
                        "`vpscluster provision` (the overlay), or insecure_network: true to accept the risk")


def credentials(cluster):
    """Where the cluster's queue is and how to log in (a `client.Credentials`), or None."""
    from vpscluster.queue.client import Credentials

    q = getattr(cluster, "queue", None)
    if q is not None:
        _check_user_server(cluster)

        def secret(path):
            try:
                return Path(path).read_text().strip() if path else None
            except OSError as e:
                raise UserError(f"queue: cannot read {path}: {e.strerror}; fix the cluster file's queue: entry") from None

        return Credentials(q.url, token=secret(q.token_file), user=q.user, password=secret(q.password_file))
    rec = load_record(cluster)
    if rec is None:
        return None
    try:
        token = token_path(cluster).read_text().strip()
    except OSError:
        raise UserError(f"queue: its token ({token_path(cluster)}) is gone; `vpscluster queue down --purge` and "
                        "`queue up` make a new one") from None
    return Credentials(rec.url, token=token)


# --- up / down / status ----------------------------------------------------------------------------


def _quiet(_: str) -> None:
    pass


def _refuse_user_server(cluster, what: str) -> None:
    if getattr(cluster, "queue", None) is not None:
        raise UserError(f"queue {what}: the cluster file names a server of its own ({cluster.queue.url}); vpscluster "
                        "starts and stops none then (remove its queue: entry to use `queue up`)")


def up(cluster, *, port: int = T.QUEUE_PORT, monitor_port: int = T.QUEUE_MONITOR_PORT,
       exporter_port: int = T.QUEUE_EXPORTER_PORT, max_store: int = MAX_STORE, nats_server: str = "nats-server",
       say: Callable[[str], None] = _quiet) -> QueueRecord:
    from vpscluster.cluster.netsafety import require_safe_network

    _refuse_user_server(cluster, "up")
    require_safe_network(cluster, NATS)  # public addresses without the overlay: refused, one line
    rec = load_record(cluster)
    if rec is not None and _ready(rec.monitor_url):
        raise UserError(f"the queue already runs for this cluster at {rec.url}; `vpscluster queue down` first")
    if rec is not None:  # recorded but not answering (a reboot, a crash): clear what is left
        try:
            down(cluster)
        except Exception as e:
            say(f"note: could not stop what the last `queue up` left: {e}")
    rec = asyncio.run(_up(cluster, port, monitor_port, exporter_port, max_store, nats_server, say))
    _save_record(cluster, rec)
    _publish_target(cluster, rec, say)
    return rec


async def _up(cluster, port, monitor_port, exporter_port, max_store, nats_server, say) -> QueueRecord:
    from vpscluster import nodeside
    from vpscluster.cluster.daemon import start_line
    from vpscluster.cluster.inventory import executor_for
    from vpscluster.launch.preflight import node_endpoints, resolve_workdirs

    timeout_s = cluster.connect_timeout_s + cluster.command_timeout_s
    head_node = cluster.head_node
    address = "127.0.0.1" if head_node.local else node_endpoints(cluster)[head_node.name].address
    token = _token(cluster)
    head = executor_for(head_node, cluster)
    try:
        r = await head.run(f"command -v {shlex.quote(nats_server)}", timeout_s=timeout_s)
        if not r.ok:  # before anything is started
            raise UserError(f"node {cluster.head}: no {nats_server} there; install it (Debian/Ubuntu: apt install "
                            "nats-server) or pass --nats-server PATH")
        nats_bin = r.stdout.strip().splitlines()[-1]
        workdir = (await resolve_workdirs([head], timeout_s))[head_node.name]
        qdir = posixpath.join(workdir, QUEUE_DIR)
        conf = posixpath.join(qdir, "nats.conf")
        doc = nats_config(address, port, monitor_port, qdir, token, max_store)
        r = await head.run(f"mkdir -p {shlex.quote(qdir)} && chmod 700 {shlex.quote(qdir)}", timeout_s=timeout_s)
        if not r.ok:
            raise RemoteError(f"node {cluster.head}: cannot make {qdir}: {r.reason()}")
        with tempfile.TemporaryDirectory(prefix="vpsc-queue-") as tmp:
            local = Path(tmp, "nats.conf")
            fd = os.open(local, os.O_WRONLY | os.O_CREAT, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(json.dumps(doc, indent=2) + "\n")
            await head.put(str(local), conf + ".tmp", timeout_s=timeout_s)
        r = await head.run(f"chmod 600 {shlex.quote(conf)}.tmp && mv {shlex.quote(conf)}.tmp {shlex.quote(conf)}",
                           timeout_s=timeout_s)
        if not r.ok:
            raise RemoteError(f"node {cluster.head}: cannot write {conf}: {r.reason()}")

        log = posixpath.join(qdir, "nats.log")
        r = await head.run(start_line([nats_bin, "-c", conf], log), timeout_s=timeout_s)
        if not r.ok:
            raise RemoteError(f"node {cluster.head}: could not start nats-server: {r.reason()}")
        nats_pid = int(r.stdout.strip().splitlines()[-1])
        monitor_url = f"http://{_hostport(address, monitor_port)}"
        deadline = time.monotonic() + START_TIMEOUT_S
        while not _ready(monitor_url):
            alive = await head.run(f"kill -0 {nats_pid}", timeout_s=timeout_s)
            if not alive.ok or time.monotonic() > deadline:
                tail = await head.run(f"tail -n 5 {shlex.quote(log)}", timeout_s=timeout_s)
                await head.run(_stop(nats_pid, "nats-server"), timeout_s=timeout_s)
                raise RemoteError(f"node {cluster.head}: nats-server did not come up at {address}:{port}: "
                                  f"{tail.stdout.strip()[-500:]}")
            await asyncio.sleep(0.2)

        xlog = posixpath.join(qdir, "exporter.log")
        argv = nodeside.command(head_node.python, "queue_exporter", "--nats-monitor", monitor_url, "--bind", address,
                                "--port", str(exporter_port), "--tag", EXPORTER_TAG)
        r = await head.run(start_line(argv, xlog) + f"; for i in $(seq 100); do grep -q 'queue exporter for' "
                           f"{shlex.quote(xlog)} && break; kill -0 $pid 2>/dev/null || break; sleep 0.1; done; "
                           f"cat {shlex.quote(xlog)}", timeout_s=timeout_s)
        lines = r.stdout.strip().splitlines()
        if not r.ok or not any(ln.startswith("queue exporter for") for ln in lines):
            await head.run(_stop(nats_pid, "nats-server"), timeout_s=timeout_s)
            raise RemoteError(f"node {cluster.head}: the queue exporter did not start on port {exporter_port} "
                              f"(--exporter-port): {(r.stdout or r.stderr).strip()[-300:] or r.error}")
        exporter_pid = int(next(ln for ln in lines if ln.strip().isdigit()))
    finally:
        await head.close()
    rec = QueueRecord(head=cluster.head, url=f"nats://{_hostport(address, port)}", address=address, port=port,
                      monitor_url=monitor_url, metrics_url=f"http://{_hostport(address, exporter_port)}/metrics",
                      queue_dir=qdir, nats_pid=nats_pid, exporter_pid=exporter_pid, started_at=time.time())
    say(f"NATS JetStream at {rec.url} (token in {token_path(cluster)}; streams in {rec.store_dir}, "
        f"at most {max_store / 1e9:g} GB)")
    return rec


def _stop(pid: int, pattern: str) -> str:
    from vpscluster.cluster.daemon import stop_line

    return stop_line(pid, pattern)


def _ready(monitor_url: str, timeout_s: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(monitor_url + "/healthz", timeout=timeout_s) as r:
            return r.status == 200
    except OSError:
        return False


def down(cluster, purge: bool = False, say: Callable[[str], None] = _quiet) -> bool:
    """Stop the server and its exporter (the streams stay unless `purge`); False when none was recorded
    (`purge` then still removes the streams and token a stopped queue left)."""
    from vpscluster.cluster.inventory import executor_for
    from vpscluster.launch.preflight import resolve_workdirs

    _refuse_user_server(cluster, "down")
    rec = load_record(cluster)
    if rec is None and not purge:
        return False
    timeout_s = cluster.connect_timeout_s + cluster.command_timeout_s

    async def run() -> list[str]:
        ex = executor_for(cluster.node(rec.head if rec else cluster.head), cluster)
        try:
            left = []
            for pid, pattern in (((rec.exporter_pid, EXPORTER_TAG), (rec.nats_pid, "nats-server")) if rec else ()):
                r = await ex.run(_stop(pid, pattern), timeout_s=timeout_s)
                if not r.ok or "left" in r.stdout:
                    left.append(f"{pattern} pid {pid} {r.stdout.strip() or r.error or ''}".strip())
            if purge and not left:
                qdir = rec.queue_dir if rec else posixpath.join((await resolve_workdirs([ex], timeout_s))[ex.node.name],
                                                               QUEUE_DIR)
                r = await ex.run(f"rm -rf {shlex.quote(posixpath.join(qdir, 'store'))} "
                                 f"{shlex.quote(posixpath.join(qdir, 'nats.conf'))}", timeout_s=timeout_s)
                if not r.ok:
                    left.append(f"could not remove {qdir}/store: {r.reason()}")
            return left
        finally:
            await ex.close()

    left = asyncio.run(run())
    if left:
        raise RemoteError(f"queue: node {rec.head if rec else cluster.head}: could not stop " + "; ".join(left))
    if purge:
        token_path(cluster).unlink(missing_ok=True)
    if rec is None:
        say("the queue was not running; its streams and token (if any were left) are removed")
        return False
    _publish_target(cluster, None, say)
    _save_record(cluster, None)
    say(f"stopped the queue at {rec.url}; " + ("its streams and token are removed" if purge
                                                 else f"its streams stay in {rec.store_dir} on {rec.head}"))
    return True


def status(cluster, timeout_s: float = 10.0) -> dict[str, Any]:
    """{"running", "managed", "url", ..., "streams": [{name, messages, bytes, consumers: [{name, lag, ...}]}], "lag"}."""
    from vpscluster.queue.client import QueueError, connect

    q = getattr(cluster, "queue", None)
    if q is not None:
        doc: dict[str, Any] = {"running": False, "managed": False, "url": q.url}
    else:
        rec = load_record(cluster)
        if rec is None:
            return {"running": False, "managed": True}
        doc = {"running": False, "managed": True, **rec.to_dict()}
        if not _ready(rec.monitor_url):
            return {**doc, "note": "recorded but not answering; `vpscluster queue up` starts it again, `queue down` cleans up"}
    try:
        with connect(cluster, timeout_s=timeout_s) as client:
            streams = client.streams()
    except QueueError as e:
        return {**doc, "note": str(e)}
    return {**doc, "running": True, "streams": streams,
            "lag": sum(c["lag"] for s in streams for c in s["consumers"])}


# --- Prometheus (when `monitor up` runs) --------------------------------------------------------------


def queue_targets(rec: QueueRecord) -> list[dict[str, Any]]:
    """The file_sd entry of the queue's exporter."""
    hostport = rec.metrics_url.split("//", 1)[1].split("/", 1)[0]
    return [{"targets": [hostport], "labels": {"node": rec.head, "exporter": "queue"}}]


def _publish_target(cluster, rec: QueueRecord | None, say: Callable[[str], None] = _quiet) -> None:
    """Write (or, with None, clear) targets/queue.json where the cluster's Prometheus reads it, if it runs."""
    from vpscluster.monitor import server as monitor

    mon = monitor.load_record(cluster)
    if mon is None:
        return
    try:
        monitor.write_targets(cluster, mon, "queue.json", queue_targets(rec) if rec else [])
    except Exception as e:  # monitoring is a bystander here: the queue runs either way
        say(f"note: could not update Prometheus's targets (targets/queue.json on {mon.head}): {e}")


# --- a private server on this machine (a local run, tests) -----------------------------------------


@dataclass
class PrivateServer:
    """A nats-server of one run on this machine's loopback (its own token, store and ports)."""

    creds: Any  # client.Credentials
    queue_dir: str
    proc: Any  # subprocess.Popen

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM (nats-server flushes its store), SIGKILL after `timeout_s`."""
        procutil.stop(self.proc, timeout_s)

    def __enter__(self) -> PrivateServer:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def serve_private(queue_dir: str | Path, nats_server: str = "nats-server", address: str = "127.0.0.1",
                  max_store: int = MAX_STORE) -> PrivateServer:
    """Start a nats-server for one local run: `nats_config` on `address` (loopback) with free ports
    and a fresh token, the store under `queue_dir`; returns once it answers (START_TIMEOUT_S)."""
    import shutil
    import socket
    import subprocess

    from vpscluster.queue.client import Credentials

    binary = shutil.which(nats_server)
    if binary is None:
        raise UserError(f"no {nats_server} on this machine; install it (Debian/Ubuntu: apt install nats-server)")
    qdir = Path(queue_dir).resolve()
    qdir.mkdir(parents=True, exist_ok=True)
    os.chmod(qdir, 0o700)
    ports = []
    for _ in range(2):
        with socket.socket() as s:
            s.bind((address, 0))
            ports.append(s.getsockname()[1])
    token = secrets.token_urlsafe(32)
    conf = qdir / "nats.conf"
    fd = os.open(conf, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps(nats_config(address, ports[0], ports[1], str(qdir), token, max_store), indent=2) + "\n")
    log = open(qdir / "nats.log", "wb")
    try:
        proc = subprocess.Popen([binary, "-c", str(conf)], stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    finally:
        log.close()
    server = PrivateServer(Credentials(f"nats://{_hostport(address, ports[0])}", token=token), str(qdir), proc)
    monitor_url = f"http://{_hostport(address, ports[1])}"
    deadline = time.monotonic() + START_TIMEOUT_S
    while not _ready(monitor_url, timeout_s=1.0):
        if proc.poll() is not None or time.monotonic() > deadline:
            server.stop()
            tail = (qdir / "nats.log").read_text(errors="replace").strip()[-300:]
            raise RemoteError(f"nats-server did not come up at {address}:{ports[0]}: {tail}")
        time.sleep(0.1)
    return server
