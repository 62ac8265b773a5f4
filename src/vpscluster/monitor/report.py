"""`vpscluster report RUN_DIR`: one self-contained HTML file showing where a run's time and bytes went.

    write_report(run_dir) -> Path   # RUN_DIR/report.html; also written at the end of `train`

From the run directory alone (metrics.jsonl, report.json, config.yaml, exporters.json) plus the
cluster's saved probe and the planner: loss and validation-loss curves, tokens/s and the
communication share over time, compute vs communication per rank, bytes per node against its
egress quota, the probe's bandwidth matrix as a heat map, the plan's predictions next to what
was measured, and the ports the exporters served on. Charts are plotly with its JavaScript
embedded once, so the file opens offline and makes no network request.
"""

from __future__ import annotations

import html
import json
from pathlib import Path
from typing import Any

REPORT_HTML = "report.html"
SMOOTH = 10  # steps in the moving average of tokens/s and communication share


def _moving(values: list[float], n: int) -> list[float]:
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= n:
            acc -= values[i - n]
        out.append(acc / min(i + 1, n))
    return out


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _cluster_and_probe(cfg) -> tuple[Any, dict | None]:
    try:
        from vpscluster.cluster.inventory import load_cluster, local_cluster
        from vpscluster.probe.store import load_probe

        cluster = load_cluster(cfg.cluster) if cfg and cfg.cluster else local_cluster()
        return cluster, load_probe(cluster)
    except Exception:  # the report shows what it can: a moved cluster file loses only its charts
        return None, None


def _prediction(cfg, report: dict) -> dict | None:
    try:
        from vpscluster.plan.api import PlanRequest, make_plan

        details = report.get("strategy_details") or {}
        return make_plan(PlanRequest(model=cfg.preset, cluster=cfg.cluster, strategy=report["strategy"],
                                     sync_every=details.get("sync_every") or cfg.strategy.sync_every,
                                     wire_dtype=details.get("wire_dtype") or cfg.strategy.wire_dtype,
                                     nodes=None if cfg.cluster else report["world_size"],
                                     batch_size=cfg.batch_size or None, tokens=float(report["tokens"])))
    except Exception:  # no prediction for this run (e.g. a preset the planner does not know)
        return None


def figures(run_dir: Path) -> tuple[list[tuple[str, Any]], dict[str, Any]]:
    """[(title, plotly figure)] and the tables' facts, from the run directory."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    from vpscluster.train import rundir
    from vpscluster.train.metrics import read_metrics

    lines = read_metrics(run_dir / rundir.METRICS)
    report = _read_json(run_dir / rundir.REPORT) or {}
    try:
        cfg = rundir.read_config(run_dir)
    except Exception:
        cfg = None
    steps = [x for x in lines if "loss" in x]
    evals = [x for x in lines if "val_loss" in x]
    figs: list[tuple[str, Any]] = []

    f = go.Figure()
    f.add_scatter(x=[x["step"] for x in steps], y=[x["loss"] for x in steps], name="train loss", mode="lines")
    f.add_scatter(x=[x["step"] for x in evals], y=[x["val_loss"] for x in evals], name="validation loss", mode="lines+markers")
    f.update_layout(xaxis_title="step", yaxis_title="loss")
    figs.append(("Loss", f))

    # `train` counts tokens a step; a session (`vpscluster run`) counts the samples its script reports
    unit = "tokens" if all("tokens" in x for x in steps) else "samples"
    tps = [x.get(unit, 0) / x["step_seconds"] if x["step_seconds"] > 0 else 0.0 for x in steps]
    share = [x["comm_seconds"] / x["step_seconds"] if x["step_seconds"] > 0 else 0.0 for x in steps]
    f = make_subplots(specs=[[{"secondary_y": True}]])
    f.add_scatter(x=[x["step"] for x in steps], y=_moving(tps, SMOOTH), name=f"{unit}/s ({SMOOTH}-step mean)", mode="lines")
    f.add_scatter(x=[x["step"] for x in steps], y=_moving(share, SMOOTH), name="communication share", mode="lines",
                  secondary_y=True)
    f.update_yaxes(title_text=f"{unit}/s", secondary_y=False)
    f.update_yaxes(title_text="communication share", range=[0, 1], tickformat=".0%", secondary_y=True)
    f.update_xaxes(title_text="step")
    figs.append(("Throughput and communication", f))

    per_rank = report.get("per_rank") or []
    exporters = (_read_json(run_dir / "exporters.json") or {}).get("exporters", [])
    node_of = {e["rank"]: e["node"] for e in exporters}
    f = go.Figure()
    names = [f"rank {r['rank']}" + (f" ({node_of[r['rank']]})" if r["rank"] in node_of else "") for r in per_rank]
    f.add_bar(x=names, y=[r["compute_seconds"] for r in per_rank], name="compute")
    f.add_bar(x=names, y=[r["comm_seconds"] for r in per_rank], name="communication")
    f.update_layout(barmode="stack", yaxis_title="seconds")
    figs.append(("Compute vs communication per rank (node)", f))

    cluster, probe = _cluster_and_probe(cfg)
    by_node: dict[str, float] = {}
    for r in per_rank:
        node = node_of.get(r["rank"], f"rank {r['rank']}")
        by_node[node] = by_node.get(node, 0.0) + r["bytes_sent"]
    f = go.Figure()
    f.add_bar(x=list(by_node), y=list(by_node.values()), name="bytes sent in this run")
    quotas = {}
    if cluster is not None:
        quotas = {n.name: n.egress_quota_bytes for n in cluster.nodes if getattr(n, "egress_quota_bytes", None)}
    if quotas:
        f.add_scatter(x=list(quotas), y=list(quotas.values()), mode="markers", marker_symbol="line-ew-open",
                      marker_size=40, name="egress quota")
    f.update_layout(yaxis_title="bytes")
    figs.append(("Bytes per node" + (" against the egress quota" if quotas else " (no egress_quota in the cluster file)"), f))

    links = [x for x in (probe or {}).get("links", []) if x.get("bandwidth_mbit") is not None]
    if links:
        nodes = sorted({x["src"] for x in links} | {x["dst"] for x in links})
        z = [[None] * len(nodes) for _ in nodes]
        for x in links:
            z[nodes.index(x["src"])][nodes.index(x["dst"])] = x["bandwidth_mbit"]
        f = go.Figure(go.Heatmap(z=z, x=nodes, y=nodes, colorscale="Viridis", colorbar_title="Mbit/s",
                                 hovertemplate="%{y} → %{x}: %{z} Mbit/s<extra></extra>"))
        f.update_layout(xaxis_title="to", yaxis_title="from")
        figs.append(("Measured bandwidth between nodes (probe)", f))

    pred = _prediction(cfg, report) if cfg is not None and report else None
    facts = {"report": report, "exporters": exporters, "prediction": pred, "probe": probe is not None}
    if pred:
        measured = {"step seconds": report["wall_seconds"] / max(1, report["steps"]),
                    "tokens/s": report["tokens_per_s"],
                    "comm seconds per step": report["comm_seconds"] / max(1, report["steps"]),
                    "compute utilization": report["compute_utilization"]}
        predicted = {"step seconds": pred["step_seconds"], "tokens/s": pred["tokens_per_s"],
                     "comm seconds per step": pred["comm_seconds"], "compute utilization": pred["compute_utilization"]}
        f = go.Figure()
        f.add_bar(x=list(predicted), y=[predicted[k] / measured[k] if measured[k] else None for k in predicted],
                  name="predicted / measured")
        f.add_hline(y=1.0, line_dash="dot")
        f.update_layout(yaxis_title="predicted / measured", yaxis_type="log")
        figs.append(("The plan's predictions against what was measured", f))
        facts["comparison"] = {k: (predicted[k], measured[k]) for k in predicted}
    return figs, facts


def render(run_dir: Path) -> str:
    import plotly.io as pio

    figs, facts = figures(run_dir)
    report = facts["report"]
    parts = []
    for i, (title, fig) in enumerate(figs):
        fig.update_layout(height=380, margin={"l": 60, "r": 30, "t": 30, "b": 50}, template="plotly_white")
        parts.append(f"<section class='chart'><h2>{html.escape(title)}</h2>"
                     + pio.to_html(fig, include_plotlyjs=(i == 0), full_html=False, div_id=f"chart-{i}",
                                   config={"displaylogo": False}) + "</section>")
    summary = [("strategy", report.get("strategy")), ("ranks", report.get("world_size")), ("steps", report.get("steps")),
               ("tokens", report.get("tokens")), ("wall seconds", report.get("wall_seconds")),
               ("tokens/s", report.get("tokens_per_s")), ("compute utilization", report.get("compute_utilization")),
               ("final train loss", report.get("final_train_loss")), ("final validation loss", report.get("final_val_loss"))]
    rows = "".join(f"<tr><th>{html.escape(k)}</th><td>{_fmt(v)}</td></tr>" for k, v in summary if v is not None)
    comp = facts.get("comparison")
    comp_rows = "".join(f"<tr><th>{html.escape(k)}</th><td>{_fmt(p)}</td><td>{_fmt(m)}</td></tr>" for k, (p, m) in (comp or {}).items())
    ports = "".join(f"<tr><td>{e['rank']}</td><td>{html.escape(e['node'])}</td><td>{html.escape(e['address'])}:{e['rank_port']}</td>"
                    f"<td>{(html.escape(e['address']) + ':' + str(e['node_port'])) if e.get('node_port') else ''}</td></tr>"
                    for e in facts["exporters"])
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>vpscluster run {html.escape(run_dir.name)}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1100px; color: #222; }}
table {{ border-collapse: collapse; margin: 0.5em 0 1.5em; }} th, td {{ padding: 0.2em 0.8em; border-bottom: 1px solid #ddd; text-align: left; }}
section.chart {{ margin-bottom: 1.5em; }} h2 {{ font-size: 1.1em; margin-bottom: 0.2em; }}
</style></head><body>
<h1>Run {html.escape(run_dir.name)}</h1>
<table>{rows}</table>
{''.join(parts)}
{f"<h2>Plan vs measured</h2><table><tr><th></th><th>predicted</th><th>measured</th></tr>{comp_rows}</table>" if comp else "<p>No plan prediction for this run.</p>"}
<h2>Metrics exporters of this run</h2>
{f"<table><tr><th>rank</th><th>node</th><th>rank exporter</th><th>node exporter</th></tr>{ports}</table>" if ports else "<p>This run served no Prometheus metrics.</p>"}
<p>The head's Prometheus (<code>vpscluster monitor up</code>) must reach these ports; nothing else needs to.</p>
</body></html>
"""


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, int):
        return f"{v:,}"
    return html.escape(str(v))


def write_report(run_dir: str | Path) -> Path:
    from vpscluster.errors import UserError
    from vpscluster.train import rundir

    run_dir = Path(run_dir)
    if not (run_dir / rundir.METRICS).exists():
        raise UserError(f"{run_dir}: no {rundir.METRICS} here; pass a training run directory")
    out = run_dir / REPORT_HTML
    tmp = out.with_suffix(".html.tmp")
    tmp.write_text(render(run_dir))
    tmp.replace(out)
    return out
