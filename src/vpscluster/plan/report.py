"""Render a plan document for people (rich): the choice, the candidates, memory, egress, guidance."""

from __future__ import annotations

from vpscluster.train.strategies import STRATEGIES
from vpscluster.units import format_bytes, format_rate_mbit


def duration(seconds: float | None) -> str:
    if seconds is None:
        return "—"
    if seconds < 120:
        return f"{seconds:.2f}s" if seconds < 10 else f"{seconds:.0f}s"
    if seconds < 2 * 3600:
        return f"{seconds / 60:.1f}min"
    if seconds < 2 * 86400:
        return f"{seconds / 3600:.1f}h"
    return f"{seconds / 86400:.1f}d"


def render(doc: dict, console) -> None:
    from rich import box
    from rich.panel import Panel
    from rich.table import Table

    m = doc["model"]
    console.print(
        f"[bold]Model[/] {m['name']}: {m['num_params'] / 1e6:.1f}M parameters, {m['n_layer']} layers x d {m['d_model']}, "
        f"seq {m['seq_len']}, batch {m['batch_size']} per rank; {doc['world_size']} rank(s); "
        f"target {doc['tokens']:.3g} tokens")

    nodes = Table(title="Nodes", title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    for col in ("node", "GFLOP/s", "compute", "memory need/has", "fits", "egress/day", "quota"):
        nodes.add_column(col, justify="left" if col == "node" else "right", no_wrap=col == "node")
    for n in doc["nodes"]:
        quota = "—"
        if n["egress_quota_bytes"]:
            quota = f"{format_bytes(n['egress_quota_bytes'])}/{n['egress_quota_period_s'] / 86400:g}d"
            if n["egress_exceeded_after_s"] is not None:
                quota = f"[red]{quota}: out after {duration(n['egress_exceeded_after_s'])}[/]"
        nodes.add_row(
            n["name"], f"{n['flops'] / 1e9:.1f}", duration(n["compute_seconds"]),
            f"{format_bytes(n['memory_bytes'])}/{format_bytes(n['memory_available_bytes'])} {n['memory_kind']}",
            "[green]yes[/]" if n["fits"] else "[red]no[/]", format_bytes(n["egress_bytes_per_day"]), quota)
    console.print(nodes)
    cal = doc.get("step_calibration") or {}
    if cal.get("nodes"):
        spread = max(v["spread"] for v in cal["nodes"].values())
        console.print(f"Compute: step time {cal['source']} on {len(cal['nodes'])} of {len(doc['nodes'])} node(s) with this "
                      f"model (median of repeats, spread up to {spread:.0%}); other nodes: probe FLOP/s")
    ring = doc["ring"]
    if ring["weakest_link_mbit"] is not None:
        worst = ring.get("worst_order_weakest_link_mbit")
        console.print(f"Ring {' → '.join(ring['order'])} → {ring['order'][0]}: weakest link "
                      f"{format_rate_mbit(ring['weakest_link_mbit'])}"
                      + (f" (a bad order would be {format_rate_mbit(worst)})" if worst and worst < ring['weakest_link_mbit'] else ""))

    bal = doc.get("balance")
    if bal and bal["speedup"] > 1.005:
        console.print(
            f"[bold]Uneven nodes[/]: shares {':'.join(str(v) for v in bal['shares'])} of {bal['global_batch']} "
            f"{'micro-batches' if bal['unit'].startswith('micro') else 'sequences'} "
            f"(speeds {':'.join(f'{v:g}' for v in bal['speeds'])}): "
            + (f"a round {duration(bal['round_seconds_balanced'])} vs {duration(bal['round_seconds_even'])}"
               if "round_seconds_even" in bal else
               f"step {duration(bal['balanced_step_seconds'])} vs {duration(bal['even_step_seconds'])}")
            + f" split evenly, {bal['speedup']:.2f}x "
            f"({bal['tokens_per_s_balanced']:,.0f} vs {bal['tokens_per_s_even']:,.0f} tokens/s"
            + (f"; whole {'micro-batches' if bal['unit'].startswith('micro') else 'sequences'} make the compute "
               f"{bal['split_gap']:.0%} longer than an exact split"
               if bal.get("split_gap", 0) >= 0.005 else "") + "); "
            f"train with {bal['train_flags']}")

    cands = Table(title="Strategies, fastest to the token target first", title_justify="left",
                  box=box.SIMPLE_HEAD, pad_edge=False)
    for col in ("strategy", "step", "comm", "util", "to train", "sent/day", "risk"):
        cands.add_column(col, justify="left" if col == "strategy" else "right", no_wrap=True)
    for c in doc["candidates"]:
        style = "bold green" if c["label"] == doc["label"] else None
        cands.add_row(
            c["label"], duration(c["step_seconds"]), duration(c["comm_seconds"]),
            f"{c['compute_utilization']:.0%}", duration(c["time_to_train_seconds"]),
            format_bytes(c["egress_bytes_per_node_per_day"]),
            c["quality_risk"] + ("" if c["fits"] else " [red]no fit[/]"), style=style)
    console.print(cands)

    console.print(Panel(
        f"[bold]{doc['label']}[/]: step {duration(doc['step_seconds'])} (compute {duration(doc['compute_seconds'])}, "
        f"communication {duration(doc['comm_seconds'])}), {doc['tokens_per_s']:,.0f} tokens/s, "
        f"utilization {doc['compute_utilization']:.0%}, {doc['steps']:,} steps, "
        f"time to train {duration(doc['time_to_train_seconds'])}\n{doc['reason']}",
        title="Plan", title_align="left"))

    comp = doc["memory"]["components"]
    console.print("[bold]Memory per rank[/]: " + ", ".join(f"{k.replace('_', ' ')} {format_bytes(v)}" for k, v in comp.items())
                  + f" = {format_bytes(doc['memory_bytes_per_node'])}")
    by_strategy = []
    for strategy in STRATEGIES:
        opts = [o for o in doc["memory"]["options"] if o["strategy"] == strategy]
        if opts:
            first_fit = next((o for o in opts if o["fits"]), None)
            by_strategy.append(f"{strategy} {format_bytes(opts[0]['memory_bytes_per_node'])}"
                               + ("" if opts[0]["fits"] else
                                  f" (fits with {first_fit['layout']}: {format_bytes(first_fit['memory_bytes_per_node'])})"
                                  if first_fit else " (no layout fits)"))
    console.print("[bold]Memory per rank by strategy[/]: " + "; ".join(by_strategy))
    if "fix" in doc["memory"]:
        console.print(f"[red]Does not fit.[/] To fit: {doc['memory']['fix']}")
    for w in doc["egress"]["warnings"]:
        console.print(f"[red]Egress quota:[/] {w}")

    g = doc["guidance"]
    rate = g["ddp_link_mbit_for_90pct_utilization"]
    lines = [
        f"least memory per node: {format_bytes(g['least_memory_bytes_per_node'])} {g['memory_kind']} "
        f"({g['least_memory_layout']}); as configured {format_bytes(g['memory_bytes_per_node_as_configured'])}",
        "DDP reaches 90% utilization at " + (format_rate_mbit(rate) + " per link" if rate is not None else g.get("ddp_link_note", "no rate")),
        f"loading a {format_bytes(g['checkpoint_bytes'])} checkpoint within {g['checkpoint_load_within_s']:g} s needs "
        f"{g['disk_read_mb_s_needed']:.0f} MB/s disk reads"
        + (f" (slowest disk: {g['slowest_disk_read_mb_s']:.0f} MB/s, {duration(g['checkpoint_load_seconds_on_slowest_disk'])})"
           if g["slowest_disk_read_mb_s"] else ""),
    ]
    console.print("[bold]Hardware guidance[/]\n" + "\n".join(f"  • {line}" for line in lines))
    if doc["assumptions"]:
        console.print("[bold yellow]Assumed (not measured)[/]\n" + "\n".join(f"  • {a}" for a in doc["assumptions"]))
