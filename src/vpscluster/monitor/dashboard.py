"""A Grafana dashboard over vpscluster's metrics, generated from `telemetry`'s definitions.

One panel per metric: gauges as they are, counters as per-second rates, histograms as p50/p95;
per-node metrics by node, per-rank metrics by rank. Generated, so it cannot drift from what the
exporters serve. Import it in Grafana (Dashboards → Import) and pick the Prometheus data source.
"""

from __future__ import annotations

from typing import Any

from vpscluster import telemetry as T


def _targets(m: T.Metric) -> list[dict[str, Any]]:
    by = "node" if "rank" not in m.labels else "rank, node"
    if m.kind == "counter":
        return [{"expr": f"sum by ({by}) (rate({m.sample}[1m]))", "legendFormat": "{{node}} {{rank}}", "refId": "A"}]
    if m.kind == "histogram":
        extra = ", kind" if "kind" in m.labels else ""
        return [{"expr": f"histogram_quantile({q}, sum by (le, {by}{extra}) (rate({m.name}_bucket[1m])))",
                 "legendFormat": f"p{int(q * 100)} {{{{node}}}} {{{{rank}}}}" + (" {{kind}}" if extra else ""), "refId": ref}
                for q, ref in ((0.5, "A"), (0.95, "B"))]
    return [{"expr": f"max by ({by}) ({m.sample})", "legendFormat": "{{node}} {{rank}}", "refId": "A"}]


def _unit(m: T.Metric) -> str:
    if m.kind == "counter" and m.unit == "bytes":
        return "Bps"
    return m.unit or "short"


def dashboard() -> dict[str, Any]:
    panels = []
    sections = (("Nodes", T.NODE_METRICS), ("Ranks", T.RANK_METRICS))
    y = 0
    pid = 1
    for title, metrics in sections:
        panels.append({"type": "row", "title": title, "id": pid, "collapsed": False, "gridPos": {"x": 0, "y": y, "w": 24, "h": 1}})
        pid, y = pid + 1, y + 1
        for i, m in enumerate(metrics):
            panels.append({
                "type": "timeseries", "id": pid, "title": m.name.removeprefix("vpscluster_").replace("_", " "),
                "description": m.help + (" (per second)" if m.kind == "counter" else ""),
                "datasource": {"type": "prometheus", "uid": "${datasource}"},
                "fieldConfig": {"defaults": {"unit": _unit(m)}, "overrides": []},
                "gridPos": {"x": (i % 3) * 8, "y": y + (i // 3) * 8, "w": 8, "h": 8},
                "targets": _targets(m),
            })
            pid += 1
        y += ((len(metrics) + 2) // 3) * 8
    return {
        "title": "vpscluster", "uid": "vpscluster", "schemaVersion": 39, "version": 1, "refresh": "10s",
        "time": {"from": "now-1h", "to": "now"}, "tags": ["vpscluster"],
        "templating": {"list": [{"name": "datasource", "type": "datasource", "query": "prometheus", "label": "Prometheus"}]},
        "panels": panels,
    }
