"""Load figures from Prometheus's HTTP API: what `top` shows and what scheduling reads.

    prom = prometheus_for(cluster)              # the server `vpscluster monitor up` started
    cpu_utilization(prom)   -> {node: 0..1}     # usage over the node's quota, last `window`
    cpu_capacity(prom)      -> {node: cores}    # what the node may use (quota, else CPUs)
    memory(prom)            -> {node: {"used_bytes": B, "total_bytes": B}}
    link_rates(prom)        -> {node: {interface: {"tx": B/s, "rx": B/s}}}
    sync_latency(prom)      -> {kind: {"p50": s, "p95": s}}

Node figures come from vpscluster's own node exporter (`vpscluster_node_*`: CPU over the cgroup
quota) and, for nodes it does not cover, from Debian's `prometheus-node-exporter` (the standard
`node_*` names: `node_cpu_seconds_total`, `node_memory_MemTotal_bytes` / `MemAvailable_bytes`,
`node_network_{receive,transmit}_bytes_total`; its CPU figure is the machine's /proc/stat). Both
give the same shapes, so `top` and a scheduler need not know which one a node runs.

Every call has a time-out and raises `RemoteError` naming the server when it does not answer.
"""

from __future__ import annotations

import json
import urllib.parse
import urllib.request
from typing import Any

from vpscluster import telemetry as T
from vpscluster.errors import RemoteError, UserError

DEFAULT_WINDOW = "30s"

# The standard names of Debian's prometheus-node-exporter (upstream node_exporter's).
STD_CPU_SECONDS = "node_cpu_seconds_total"  # labels cpu, mode
STD_MEM_TOTAL = "node_memory_MemTotal_bytes"
STD_MEM_AVAILABLE = "node_memory_MemAvailable_bytes"
STD_NET_RX = "node_network_receive_bytes_total"  # label device
STD_NET_TX = "node_network_transmit_bytes_total"


class Prometheus:
    def __init__(self, url: str, timeout_s: float = 5.0, tunnel=None) -> None:
        self.url, self.timeout_s = url.rstrip("/"), timeout_s
        self.tunnel = tunnel  # the SSH tunnel `url` goes through (monitor/tunnel.py), or None

    def close(self) -> None:
        if self.tunnel is not None:
            self.tunnel.close()

    def __enter__(self) -> "Prometheus":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _get(self, path: str, **params: str) -> Any:
        url = f"{self.url}{path}" + ("?" + urllib.parse.urlencode(params) if params else "")
        try:
            with urllib.request.urlopen(url, timeout=self.timeout_s) as r:
                doc = json.loads(r.read())
        except OSError as e:
            raise RemoteError(f"Prometheus at {self.url} did not answer ({e}); is `vpscluster monitor up` running?") from None
        if doc.get("status") != "success":
            raise RemoteError(f"Prometheus at {self.url}: {doc.get('error', doc)}")
        return doc["data"]

    def query(self, promql: str) -> list[tuple[dict[str, str], float]]:
        """An instant query: (labels, value) per series."""
        data = self._get("/api/v1/query", query=promql)
        return [(s["metric"], float(s["value"][1])) for s in data.get("result", [])]

    def query_range(self, promql: str, start: float, end: float, step_s: float) -> list[tuple[dict[str, str], list[tuple[float, float]]]]:
        data = self._get("/api/v1/query_range", query=promql, start=str(start), end=str(end), step=f"{step_s}s")
        return [(s["metric"], [(float(t), float(v)) for t, v in s["values"]]) for s in data.get("result", [])]

    def targets(self) -> list[dict[str, Any]]:
        """Active targets: url, labels, health ("up"/"down"/"unknown"), last error."""
        data = self._get("/api/v1/targets", state="active")
        return [{"url": t["scrapeUrl"], "labels": t.get("labels", {}), "health": t["health"], "error": t.get("lastError", "")}
                for t in data.get("activeTargets", [])]


def prometheus_for(cluster, timeout_s: float = 5.0) -> Prometheus:
    from vpscluster.monitor.server import load_record

    rec = load_record(cluster)
    if rec is None:
        raise UserError("no monitoring runs for this cluster; start it with `vpscluster monitor up`")
    if rec.tunnel:  # it listens on the head's overlay address: through SSH to the head
        from urllib.parse import urlsplit

        from vpscluster.monitor.tunnel import Tunnel

        where = urlsplit(rec.url)
        tunnel = Tunnel(cluster, rec.head, where.hostname or "", where.port or 0, timeout_s=max(timeout_s, 30.0))
        return Prometheus(f"http://127.0.0.1:{tunnel.port}", timeout_s, tunnel=tunnel)
    return Prometheus(rec.url, timeout_s)


def _by(rows, *keys: str) -> dict:
    out: dict = {}
    for labels, value in rows:
        if value != value:  # NaN: no data in the window
            continue
        d = out
        for k in keys[:-1]:
            d = d.setdefault(labels.get(k, ""), {})
        d[labels.get(keys[-1], "")] = value
    return out


def cpu_utilization(prom: Prometheus, window: str = DEFAULT_WINDOW) -> dict[str, float]:
    """Per node: CPU used over what the node may use (its quota), averaged over `window`.

    From the CPU-seconds counter and the capacity gauge; a node scraped once only so far falls
    back to the exporter's own figure."""
    rate = (f"max by (node) (rate({T.CPU_SECONDS.sample}[{window}])) / "
            f"max by (node) ({T.CPU_CAPACITY.sample})")
    out = {k: min(1.0, max(0.0, v)) for k, v in _by(prom.query(rate), "node").items()}
    for node, v in _by(prom.query(f"max by (node) ({T.CPU_UTILIZATION.sample})"), "node").items():
        out.setdefault(node, v)
    std = f'1 - avg by (node) (rate({STD_CPU_SECONDS}{{mode="idle"}}[{window}]))'
    for node, v in _by(prom.query(std), "node").items():
        out.setdefault(node, min(1.0, max(0.0, v)))
    return out


def cpu_capacity(prom: Prometheus) -> dict[str, float]:
    """Per node: the cores it may use (its cgroup quota, else its CPUs; Debian's exporter: CPUs)."""
    out = _by(prom.query(f"max by (node) ({T.CPU_CAPACITY.sample})"), "node")
    for node, v in _by(prom.query(f'count by (node) ({STD_CPU_SECONDS}{{mode="idle"}})'), "node").items():
        out.setdefault(node, v)
    return out


def memory(prom: Prometheus) -> dict[str, dict[str, float]]:
    """Per node: memory in use and the memory it may use, in bytes."""
    out: dict[str, dict[str, float]] = {}
    for key, mine, std in (("used_bytes", T.MEMORY_USED.sample, f"{STD_MEM_TOTAL} - {STD_MEM_AVAILABLE}"),
                           ("total_bytes", T.MEMORY_TOTAL.sample, STD_MEM_TOTAL)):
        for node, v in _by(prom.query(f"max by (node) ({mine})"), "node").items():
            out.setdefault(node, {})[key] = v
        for node, v in _by(prom.query(f"max by (node) ({std})"), "node").items():
            out.setdefault(node, {}).setdefault(key, v)
    return out


def link_rates(prom: Prometheus, window: str = DEFAULT_WINDOW, include_loopback: bool = False) -> dict[str, dict[str, dict[str, float]]]:
    """Per node and interface: bytes/s sent ("tx") and received ("rx") over `window`."""
    sel = "" if include_loopback else '{interface!="lo"}'
    std_sel = "" if include_loopback else '{device!="lo"}'
    out: dict[str, dict[str, dict[str, float]]] = {}
    for key, metric in (("tx", T.NET_TX), ("rx", T.NET_RX)):
        rows = prom.query(f"max by (node, interface) (rate({metric.sample}{sel}[{window}]))")
        for node, per_if in _by(rows, "node", "interface").items():
            for iface, v in per_if.items():
                out.setdefault(node, {}).setdefault(iface, {})[key] = v
    mine = set(out)  # nodes the builtin exporter covers; Debian's fills in the others
    for key, metric in (("tx", STD_NET_TX), ("rx", STD_NET_RX)):
        rows = prom.query(f"max by (node, device) (rate({metric}{std_sel}[{window}]))")
        for node, per_if in _by(rows, "node", "device").items():
            if node in mine:
                continue
            for iface, v in per_if.items():
                out.setdefault(node, {}).setdefault(iface, {})[key] = v
    return out


def sync_latency(prom: Prometheus, window: str = "5m") -> dict[str, dict[str, float]]:
    """Per kind of sync ("step", "outer"): p50 and p95 latency in seconds over `window`."""
    out: dict[str, dict[str, float]] = {}
    for name, q in (("p50", 0.5), ("p95", 0.95)):
        rows = prom.query(f"histogram_quantile({q}, sum by (le, kind) (rate({T.SYNC_SECONDS.name}_bucket[{window}])))")
        for kind, v in _by(rows, "kind").items():
            out.setdefault(kind, {})[name] = v
    return out
