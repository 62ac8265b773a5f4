"""Prometheus exporters inside training: one per rank, and the node's on each node's local rank 0.

Every rank serves the metrics of `telemetry.RANK_METRICS` on `RANK_PORT_BASE + local_rank`
(a taken port falls back to a free one); local rank 0 also serves the node exporter
(probe/node_exporter.py) on `NODE_PORT` for the run's duration. Both bind the address this node
uses to reach the rendezvous host, so they are reachable from the cluster and from nowhere else
the machine has an interface. They live in the worker process, so they start and stop with it:
the launch's teardown, which ends every worker, ends them too.

Updating a metric is a few dict look-ups and a lock; the HTTP server runs on its own thread and
reads only when scraped. What the exporters cost is counted, not guessed: `cpu_seconds()` is the
time the loop spent in the updates plus the CPU time of the server threads (scrapes served, the
node figures read), from each thread's own CPU clock; the run's report lists it per rank. Where
prometheus_client is not installed, or `exporters: false`, ranks get a `NullRankExporter` and
the loop does not change.
"""

from __future__ import annotations

import os
import socket
import sys
import time
from typing import Any

from vpscluster import telemetry as T


def cluster_address() -> str:
    """The address this node uses to reach the rendezvous host (loopback on the local cluster)."""
    master = os.environ.get("MASTER_ADDR")
    if not master:
        return "127.0.0.1"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((master, int(os.environ.get("MASTER_PORT", "29500"))))  # UDP: sends nothing
            return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"


class RankExporter:
    def __init__(self, rank: int, local_rank: int, node: str, bind: str, workdir: str = ".") -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.rank, self.local_rank, self.node, self.bind = rank, local_rank, node, bind
        self.workdir = workdir
        self.registry = CollectorRegistry(auto_describe=False)
        made: dict[str, Any] = {}
        for m in T.RANK_METRICS:
            cls = {"gauge": Gauge, "counter": Counter, "histogram": Histogram}[m.kind]
            kw = {"buckets": T.SECONDS_BUCKETS} if m.kind == "histogram" else {}
            made[m.name] = cls(m.name, m.help, list(m.labels), registry=self.registry, **kw)
        lab = {"rank": str(rank), "node": node}
        # Children bound to this rank's labels; the sync histogram also takes its `kind` per call.
        self._m = {m.name: made[m.name].labels(**lab) for m in T.RANK_METRICS if m.labels == T.RANK_LABELS}
        self._lab = lab
        self._sync = {kind: made[T.SYNC_SECONDS.name].labels(**lab, kind=kind) for kind in ("step", "outer")}
        self._servers: list = []
        self._threads: list = []  # the HTTP servers' threads, for their CPU time
        self._update_s = 0.0  # time the training loop spent updating metrics
        self._final_cpu_s: float | None = None
        self.rank_port: int | None = None
        self.node_port: int | None = None
        self._outer_seen: int | None = None

    def start(self) -> dict[str, Any]:
        """Serve; returns where (for the run's exporters.json)."""
        from prometheus_client import start_http_server

        try:
            server, thread = start_http_server(T.rank_port(self.local_rank), addr=self.bind, registry=self.registry)
        except OSError:  # taken (another run on this machine): any free port, listed in the run
            server, thread = start_http_server(0, addr=self.bind, registry=self.registry)
        self._servers.append(server)
        self._threads.append(thread)
        self.rank_port = server.server_address[1]
        if self.local_rank == 0:
            from vpscluster.probe.node_exporter import serve

            node_server, self.node_port, node_thread = serve(self.node, T.NODE_PORT, self.bind, self.workdir)
            self._servers.append(node_server)
            self._threads.append(node_thread)
        return self.endpoint()

    def cpu_seconds(self) -> float:
        """CPU seconds the exporters have cost this process so far: the loop's metric updates and
        the server threads' own CPU time (scrapes served, node figures read)."""
        if self._final_cpu_s is not None:
            return self._final_cpu_s
        total = self._update_s
        for t in self._threads:
            try:
                total += time.clock_gettime(time.pthread_getcpuclockid(t.ident))
            except (OSError, AttributeError, TypeError):  # thread gone, or no per-thread clocks here
                pass
        return total

    def endpoint(self) -> dict[str, Any]:
        return {"rank": self.rank, "local_rank": self.local_rank, "node": self.node, "address": self.bind,
                "rank_port": self.rank_port, "node_port": self.node_port}

    # ---- what the loop reports ----------------------------------------------------------------
    def step(self, step: int, loss: float | None, run_tokens: int, local_tokens: int, step_s: float, comm_s: float,
             nbytes: int, outer_syncs: int | None = None) -> None:
        t0 = time.perf_counter()
        m = self._m
        m[T.STEP.name].set(step)
        if loss is not None:  # None: this rank ran no micro-batch this step (uneven shares); the gauge keeps its last
            m[T.LOSS.name].set(loss)
        m[T.TOKENS.name].inc(local_tokens)
        m[T.TOKENS_PER_S.name].set(run_tokens / step_s if step_s > 0 else 0.0)
        m[T.STEP_SECONDS.name].observe(step_s)
        m[T.COMPUTE_SECONDS.name].observe(max(0.0, step_s - comm_s))
        m[T.COMM_SECONDS.name].observe(comm_s)
        self.communicated(nbytes)
        # A step with an outer sync (DiLoCo) is an outer sync's latency, else the step's gradient sync.
        outer = False
        if outer_syncs is not None:
            if self._outer_seen is not None and outer_syncs > self._outer_seen:
                m[T.OUTER_SYNCS.name].inc(outer_syncs - self._outer_seen)
                outer = True
            self._outer_seen = outer_syncs
        if comm_s > 0:
            self._sync["outer" if outer else "step"].observe(comm_s)
        self._update_s += time.perf_counter() - t0

    def communicated(self, nbytes: int) -> None:
        if nbytes:
            self._m[T.BYTES_SENT.name].inc(nbytes)
            self._m[T.BYTES_RECEIVED.name].inc(nbytes)

    def start_outer_count(self, outer_syncs: int | None) -> None:
        self._outer_seen = outer_syncs

    def val_loss(self, value: float) -> None:
        self._m[T.VAL_LOSS.name].set(value)

    def checkpoint(self, seconds: float) -> None:
        self._m[T.CHECKPOINT_SECONDS.name].observe(seconds)

    def close(self) -> None:
        if self._final_cpu_s is None:
            self._final_cpu_s = self.cpu_seconds()
        for s in self._servers:
            try:
                s.shutdown()
                s.server_close()
            except Exception:  # shutting down at exit: nothing to save
                pass
        self._servers.clear()


class NullRankExporter:
    rank_port = node_port = None

    def start(self) -> dict[str, Any]:
        return {}

    def endpoint(self) -> dict[str, Any]:
        return {}

    def cpu_seconds(self) -> float | None:
        return None

    def step(self, *args, **kwargs) -> None:
        pass

    def communicated(self, nbytes: int) -> None:
        pass

    def start_outer_count(self, outer_syncs) -> None:
        pass

    def val_loss(self, value: float) -> None:
        pass

    def checkpoint(self, seconds: float) -> None:
        pass

    def close(self) -> None:
        pass


def rank_exporter(enabled: bool, rank: int, local_rank: int, workdir: str = ".") -> RankExporter | NullRankExporter:
    """The rank's exporter, started; a null one when disabled or prometheus_client is missing."""
    if not enabled:
        return NullRankExporter()
    try:
        import prometheus_client  # noqa: F401
    except ImportError:
        if local_rank == 0:
            print("warning: prometheus_client is not installed on this node; no metrics exporters "
                  "(pip install 'prometheus-client>=0.17')", file=sys.stderr, flush=True)
        return NullRankExporter()
    node = os.environ.get("VPSC_NODE") or socket.gethostname()
    exporter = RankExporter(rank, local_rank, node, cluster_address(), workdir)
    exporter.start()
    return exporter
