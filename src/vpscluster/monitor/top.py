"""`vpscluster top`: one row per node from Prometheus — is a node busy, is its link full, are syncs slow?

    snap = snapshot(cluster)     # a dict: nodes (one row each), run (loss, tokens/s, step), alerts
    table = render(snap)         # a rich renderable (the CLI refreshes it, or prints --json)

Per node: CPU over its quota, memory, tx/rx bytes/s against the link's measured capacity (the
probe's fastest link from that node; the iftop question: is it full?), the ranks' step time and
communication share, and the last sync latency. Alerts: CPU above 80% (a scheduler should give
the node no new work), a link above 90% of its capacity, a sync latency far above the run's
median (then trace the path with `mtr`).
"""

from __future__ import annotations

from typing import Any

from vpscluster import telemetry as T

CPU_BUSY = 0.8
LINK_FULL = 0.9
SLOW_SYNC = 3.0  # the last sync latency over the run's median


def _per_node(prom, promql: str) -> dict[str, float]:
    return {lab.get("node", ""): v for lab, v in prom.query(promql) if v == v}


def link_capacity(probe: dict | None) -> dict[str, float]:
    """node -> bytes/s of its fastest measured link (the probe), else its advertised rate."""
    out: dict[str, float] = {}
    for link in (probe or {}).get("links", []):
        if link.get("bandwidth_mbit"):
            for node in (link["src"], link["dst"]):
                out[node] = max(out.get(node, 0.0), link["bandwidth_mbit"] * 1e6 / 8)
    for n in (probe or {}).get("nodes", []):
        if n.get("name") not in out and n.get("advertised_bandwidth_mbit"):
            out[n["name"]] = n["advertised_bandwidth_mbit"] * 1e6 / 8
    return out


def snapshot(cluster, window: str = "30s") -> dict[str, Any]:
    from vpscluster.monitor import query

    with query.prometheus_for(cluster) as prom:  # an SSH tunnel to the head over an overlay, closed after
        return _snapshot(cluster, window, prom)


def _snapshot(cluster, window: str, prom) -> dict[str, Any]:
    from vpscluster.monitor import query
    from vpscluster.probe.store import load_probe

    local = all(n.local for n in cluster.nodes)  # the local cluster's traffic is all on loopback
    cpu = query.cpu_utilization(prom, window)
    cap = query.cpu_capacity(prom)
    memory = query.memory(prom)  # either node exporter's names (vpscluster's or Debian's)
    mem = {n: m["used_bytes"] for n, m in memory.items() if "used_bytes" in m}
    mem_total = {n: m["total_bytes"] for n, m in memory.items() if "total_bytes" in m}
    rates = query.link_rates(prom, window, include_loopback=local)
    link_cap = link_capacity(load_probe(cluster))
    for lab, v in prom.query(f"max by (node) ({T.LINK_CAPACITY.sample})"):
        link_cap.setdefault(lab.get("node", ""), v)

    def ratio(num: str, den: str) -> dict[str, float]:
        return _per_node(prom, f"sum by (node) (rate({num}[{window}])) / sum by (node) (rate({den}[{window}]))")

    step_s = ratio(f"{T.STEP_SECONDS.name}_sum", f"{T.STEP_SECONDS.name}_count")
    comm_share = ratio(f"{T.COMM_SECONDS.name}_sum", f"{T.STEP_SECONDS.name}_sum")
    sync_last = ratio(f"{T.SYNC_SECONDS.name}_sum", f"{T.SYNC_SECONDS.name}_count")
    sync_median = _per_node(prom, f"histogram_quantile(0.5, sum by (le, node) (rate({T.SYNC_SECONDS.name}_bucket[30m])))")

    nodes, alerts = [], []
    for n in cluster.nodes:
        name = n.name
        per_if = rates.get(name, {})
        tx = sum(r.get("tx", 0.0) for r in per_if.values())
        rx = sum(r.get("rx", 0.0) for r in per_if.values())
        row = {"node": name, "cpu_utilization": cpu.get(name), "cpu_capacity_cores": cap.get(name),
               "memory_used_bytes": mem.get(name), "memory_total_bytes": mem_total.get(name),
               "tx_bytes_per_s": tx if per_if else None, "rx_bytes_per_s": rx if per_if else None,
               "link_capacity_bytes_per_s": link_cap.get(name), "step_seconds": step_s.get(name),
               "comm_share": comm_share.get(name), "sync_latency_s": sync_last.get(name),
               "sync_latency_median_s": sync_median.get(name), "alerts": []}
        if row["cpu_utilization"] is not None and row["cpu_utilization"] > CPU_BUSY:
            row["alerts"].append(f"CPU {row['cpu_utilization']:.0%} of its quota: give it no new work")
        capacity = row["link_capacity_bytes_per_s"]
        if capacity and max(tx, rx) > LINK_FULL * capacity:
            row["alerts"].append(f"link {max(tx, rx) / capacity:.0%} full")
        last, median = row["sync_latency_s"], row["sync_latency_median_s"]
        if last and median and last > SLOW_SYNC * median:
            row["alerts"].append(f"sync latency {last * 1e3:.0f} ms, {last / median:.1f}x its median: "
                                 f"trace the path with `mtr {n.host}`")
        alerts += [f"{name}: {a}" for a in row["alerts"]]
        nodes.append(row)

    def one(promql: str) -> float | None:
        rows = prom.query(promql)
        return rows[0][1] if rows and rows[0][1] == rows[0][1] else None

    run = {"step": one(f"max({T.STEP.sample})"), "loss": one(f'max({T.LOSS.sample}{{rank="0"}})'),
           "tokens_per_s": one(f'max({T.TOKENS_PER_S.sample}{{rank="0"}})'),
           "ranks": len(prom.query(f"{T.STEP.sample}"))}
    queue = None
    if prom.query(T.QUEUE_UP.sample):  # `queue up` runs and Prometheus scrapes its exporter
        queue = {"up": one(f"max({T.QUEUE_UP.sample})"), "lag": one(f"sum({T.QUEUE_LAG.sample})") or 0.0,
                 "unacked": one(f"sum({T.QUEUE_UNACKED.sample})") or 0.0,
                 "published_per_s": one(f"sum(rate({T.QUEUE_PUBLISHED.sample}[{window}]))"),
                 "delivered_per_s": one(f"sum(rate({T.QUEUE_DELIVERED.sample}[{window}]))"),
                 "in_bytes_per_s": one(f"sum(rate({T.QUEUE_IN_BYTES.sample}[{window}]))")}
    return {"prometheus": prom.url, "window": window, "nodes": nodes, "run": run, "queue": queue, "alerts": alerts}


def _bytes(v: float | None) -> str:
    if v is None:
        return "-"
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(v) < 1000:
            return f"{v:.0f} {unit}" if unit == "B" else f"{v:.1f} {unit}"
        v /= 1000
    return f"{v:.1f} PB"


def render(snap: dict[str, Any]):
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    t = Table(title=f"vpscluster top — {snap['prometheus']} (rates over {snap['window']})", expand=False)
    for col in ("node", "CPU / quota", "memory", "tx/s", "rx/s", "link", "step", "comm", "last sync"):
        t.add_column(col, justify="left" if col == "node" else "right")
    for r in snap["nodes"]:
        busy = r["cpu_utilization"] is not None and r["cpu_utilization"] > CPU_BUSY
        cpu = "-" if r["cpu_utilization"] is None else f"{r['cpu_utilization']:.0%}" + (
            "" if r["cpu_capacity_cores"] is None else f" of {r['cpu_capacity_cores']:.2g}")
        mem = "-" if r["memory_used_bytes"] is None else f"{_bytes(r['memory_used_bytes'])} / {_bytes(r['memory_total_bytes'])}"
        cap = r["link_capacity_bytes_per_s"]
        fill = (max(r["tx_bytes_per_s"] or 0, r["rx_bytes_per_s"] or 0) / cap) if cap else None
        link = "-" if fill is None else f"{fill:.0%} of {_bytes(cap)}/s"
        slow = any("sync latency" in a for a in r["alerts"])
        t.add_row(
            r["node"], Text(cpu, style="bold red" if busy else ""), mem, _bytes(r["tx_bytes_per_s"]), _bytes(r["rx_bytes_per_s"]),
            Text(link, style="bold red" if fill is not None and fill > LINK_FULL else ""),
            "-" if r["step_seconds"] is None else f"{r['step_seconds'] * 1e3:.0f} ms",
            "-" if r["comm_share"] is None else f"{r['comm_share']:.0%}",
            Text("-" if r["sync_latency_s"] is None else f"{r['sync_latency_s'] * 1e3:.0f} ms", style="bold red" if slow else ""),
        )
    run = snap["run"]
    line = ("no run is training" if not run["ranks"] else
            f"run: step {run['step']:.0f} on {run['ranks']} ranks, loss {run['loss']:.3f}, {run['tokens_per_s']:,.0f} tokens/s"
            if run["loss"] is not None and run["tokens_per_s"] is not None else f"run: {run['ranks']} ranks starting")
    parts = [t, Text(line)]
    q = snap.get("queue")
    if q:
        rate = lambda v: "-" if v is None else f"{v:,.1f}"  # noqa: E731
        parts.append(Text("queue: down" if not q["up"] else
                          f"queue: lag {q['lag']:.0f}, unacked {q['unacked']:.0f}, {rate(q['published_per_s'])} msg/s in, "
                          f"{rate(q['delivered_per_s'])} msg/s out, {_bytes(q['in_bytes_per_s'])}/s"))
    parts += [Text("! " + a, style="bold red") for a in snap["alerts"]]
    return Group(*parts)
