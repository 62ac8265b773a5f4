"""The probe for people: node table, bandwidth and RTT matrices, the all-reduce sweep, problems."""

from __future__ import annotations

from vpscluster.units import format_bytes

_SEVERITY_STYLE = {"error": "bold red", "warning": "yellow", "info": "cyan"}


def _num(value, fmt: str, missing: str = "-") -> str:
    return missing if value is None else format(value, fmt)


def node_table(probe: dict):
    from rich.table import Table

    t = Table(title="Nodes", title_justify="left")
    # Short headers and values: the table must fit 80 columns (CI logs, narrow terminals).
    for col in ("node", "cpu", "mem", "gpus", "disk MB/s", "python", "torch", "cuda", "GFLOP/s", "clock ms"):
        t.add_column(col, justify="right" if col in ("cpu", "mem", "disk MB/s", "GFLOP/s", "clock ms") else "left",
                     no_wrap=col in ("python", "torch", "cpu"))
    for n in probe["nodes"]:
        if not n.get("reachable"):
            t.add_row(n["name"], "[red]unreachable[/]", "", "", "", "", "", "", "", "")
            continue
        share, count = n.get("cpu_share"), n.get("cpu_count")
        cpu = f"{share:g}/{count}" if share is not None and share != count else str(count)
        gpus = ", ".join(g["name"] for g in n.get("gpus") or []) or "-"
        offset = n.get("clock_offset_s")
        t.add_row(
            n["name"], cpu,
            f"{n['memory_bytes'] / 2**30:.0f}G" if n.get("memory_bytes") else "-", gpus,
            _num(n.get("disk_read_mb_s"), ".0f"),
            n.get("python") or "-", n.get("torch") or "[red]missing[/]", _cuda_cell(n),
            _num(n["flops"] / 1e9 if n.get("flops") else None, ".1f"),
            f"{offset * 1000:+.1f}" if offset is not None else "-",
        )
    return t


def _cuda_cell(n: dict) -> str:
    """torch's CUDA build; on GPU nodes with the driver (red when they do not fit)."""
    g = n.get("gpu_check") or {}
    text = n.get("cuda") or "-"
    if not g.get("gpu"):
        return text
    text = f"{n.get('cuda') or 'cpu'} drv {g.get('driver') or '?'}"
    return f"[red]{text}[/]" if g.get("status") in ("mismatch", "driver error", "cpu build") else text


def matrix_table(probe: dict, key: str, title: str, fmt: str):
    """rows = sender, columns = receiver."""
    from rich.table import Table

    names = [n["name"] for n in probe["nodes"] if n.get("reachable")]
    cells = {(l["src"], l["dst"]): l for l in probe["links"]}
    t = Table(title=title, title_justify="left")
    t.add_column("from \\ to")
    for name in names:
        t.add_column(name, justify="right")
    adv = {n["name"]: n.get("advertised_bandwidth_mbit") for n in probe["nodes"]}
    for src in names:
        row = []
        for dst in names:
            link = cells.get((src, dst))
            if src == dst:
                row.append("·")
            elif link is None:
                row.append("")
            elif link.get("error") and link.get(key) is None:
                row.append("[red]failed[/]")
            else:
                text = _num(link.get(key), fmt)
                rates = [r for r in (adv.get(src), adv.get(dst)) if r]
                if key == "bandwidth_mbit" and rates and link.get(key) is not None and link[key] < 0.5 * min(rates):
                    text = f"[yellow]{text}[/]"
                row.append(text)
        t.add_row(src, *row)
    return t


def collectives_table(entry: dict):
    from rich.table import Table

    title = f"All-reduce sweep ({entry.get('backend', '?')}, {entry.get('world_size', len(entry.get('nodes', [])))} nodes)"
    t = Table(title=title, title_justify="left")
    for col in ("size", "time", "algbw", "busbw"):
        t.add_column(col, justify="right")
    for r in entry.get("results", []):
        t.add_row(format_bytes(r["size_bytes"]), f"{r['time_s'] * 1000:.2f} ms",
                  f"{r['algbw_bytes_per_s'] * 8 / 1e6:.1f} Mbit/s", f"{r['busbw_bytes_per_s'] * 8 / 1e6:.1f} Mbit/s")
    return t


def _flag(value) -> str:
    return "-" if value is None else "[green]yes[/]" if value else "[yellow]no[/]"


def provisioning_table(probe: dict):
    """One row per node: what `vpscluster provision` left (env hash, tcp, firewall, overlay)."""
    from rich.table import Table

    prov = probe.get("provisioning") or {}
    t = Table(title="Provisioning", title_justify="left")
    for col in ("node", "env hash", "tcp tuned", "firewall", "overlay"):
        t.add_column(col)
    match = prov.get("env_hash_match")
    for p in prov.get("nodes", []):
        if not p or len(p) == 1:
            t.add_row(p.get("name", "?"), "[red]unreachable[/]", "", "", "")
            continue
        env = p.get("env_hash") or "-"
        if p.get("env_drift"):
            env = f"[red]{env} ({len(p['env_drift'])} differ)[/]"
        elif p.get("env_hash") and match is False:
            env = f"[yellow]{env}[/]"
        ov = p.get("overlay_address") if p.get("overlay_up") else None
        t.add_row(p["name"], env, _flag(p.get("tcp_tuned")), _flag(p.get("firewall_up")),
                  f"[green]{p.get('overlay_interface')} {ov}[/]" if ov else _flag(False if prov.get("overlay") else None))
    cost = probe.get("overlay_cost") or {}
    if cost.get("bandwidth_ratio") is not None:
        added = cost.get("rtt_added_ms")
        t.add_row("overlay cost", "", "", "",
                  f"bandwidth x{cost['bandwidth_ratio']:.2f}" + (f", RTT {added:+.2f} ms" if added is not None else ""))
    return t


def problems_table(problems: list[dict]):
    from rich.table import Table

    t = Table(title="Problems", title_justify="left", show_lines=False)
    for col in ("severity", "code", "nodes", "problem", "fix"):
        t.add_column(col, overflow="fold")
    for p in problems:
        style = _SEVERITY_STYLE.get(p["severity"], "")
        t.add_row(f"[{style}]{p['severity']}[/]", p["code"], ", ".join(p["nodes"]), p["message"], p.get("fix", ""))
    return t


def regions_line(probe: dict) -> str:
    """`regions (from the links): region-1 node-1,node-2 190 Mbit/s inside, 29 between; ...`"""
    source = {"labels": "from labels.region", "measured": "from the links"}.get(probe.get("regions_from"), "")
    parts = []
    for r in probe["regions"]:
        rates = [f"{_num(r['inside_mbit'], '.0f')} Mbit/s inside"] if r.get("inside_mbit") is not None else []
        if r.get("between_mbit") is not None:
            rates.append(f"{_num(r['between_mbit'], '.0f')} between")
        parts.append(f"{r['name']} {','.join(r['nodes'])}" + (f" {', '.join(rates)}" if rates else ""))
    return f"regions ({source}): " + "; ".join(parts)


def render(probe: dict, console) -> None:
    console.print(node_table(probe))
    if probe["links"]:
        console.print(matrix_table(probe, "bandwidth_mbit", "Bandwidth Mbit/s (row -> column)", ".1f"))
        console.print(matrix_table(probe, "rtt_ms", "RTT ms (median)", ".2f"))
    if len(probe.get("regions") or []) > 0 and probe["links"]:
        console.print(regions_line(probe), soft_wrap=True)
    for entry in probe.get("collectives", []):
        if entry.get("error"):
            console.print(f"[yellow]all-reduce sweep failed:[/] {entry['error']}")
            continue
        console.print(collectives_table(entry))
        beta = entry.get("beta_bytes_per_s")
        console.print(f"fitted t(m) = α + m/β: α = {entry['alpha_s'] * 1e3:.3f} ms, β = {beta * 8 / 1e6:.1f} Mbit/s "
                      f"(bus {entry['bus_beta_bytes_per_s'] * 8 / 1e6:.1f} Mbit/s)"
                      if beta else "fitted β: not positive (too noisy)")
    if (probe.get("cluster") or {}).get("source") and probe.get("provisioning"):
        console.print(provisioning_table(probe))
    if probe["problems"]:
        console.print(problems_table(probe["problems"]))
    else:
        console.print("[green]No problems found.[/]")
    where = f"; saved to {probe['saved_to']}" if probe.get("saved_to") else ""
    console.print(f"probed {len(probe['nodes'])} node(s) in {probe['duration_s']:.1f} s{where}")
