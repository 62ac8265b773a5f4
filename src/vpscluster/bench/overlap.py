"""The overlap benchmark: how long an overlapped DiLoCo sync may be before compute waits for it.

    run_overlap(OverlapSettings(...), say=print) -> results document   (CLI: `vpscluster bench overlap`)

The sync rule (`train/strategies/sync_rule.py`, rule 2) counts an outer sync as hidden when it lasts at most
`OVERLAP_HEADROOM` of the τ inner steps it runs behind. This measures that boundary: one
sandbox (the reference nodes: 4 x 0.45 CPU, `small`), DiLoCo with a fixed H, wire and τ, and
the links' rate changed between rows (`sandbox.set_rate`) so that one sync lasts from well
inside one step to well beyond it. Each row: `vpscluster train` under the same wall-clock
budget, no evaluation (`bench wan`'s row runner).

Per row: the sync's bytes per rank and its time at the link's rate (the rule's figure, no
latency), the measured compute per inner step, their ratio (what the rule compares with the
headroom), the sync thread's measured busy time per sync, and compute utilisation
(compute / (compute + communication) per rank; also of wall time, start-up included).
Results: `out` (default bench/results/overlap-<time>/): results.json, table.md, each row's files.
`benchmarks_block(doc, command)` is the overlap block of BENCHMARKS.md (its front table and the
rows), which `vpscluster bench overlap --update-benchmarks` writes between the page's markers.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from vpscluster.bench import page, table
from vpscluster.bench.wan import BIG_STEPS, WanSettings, _machine, _run_train
from vpscluster.train.strategies import sync_rule

DEFAULT_ROWS = "int8@100mbit,int8@80mbit,int8@68mbit,int8@58mbit,bf16@100mbit"
COLUMNS: table.Columns = [
    ("row", "row", "{}"), ("sync_mb", "sync MB/rank", "{:.1f}"), ("sync_s", "sync s at rate", "{:.2f}"),
    ("step_s", "compute s/step", "{:.2f}"), ("ratio", "sync ÷ τ steps", "{:.2f}"),
    ("hidden", "rule: hidden", "{}"), ("busy_s", "busy s/sync", "{:.2f}"), ("steps", "steps", "{}"),
    ("tokens_per_s", "tok/s", "{:.0f}"), ("util", "util", "{:.1%}"), ("util_wall", "util of wall", "{:.1%}"),
]
# Issue 16's compute-utilisation target, which a sync within the rule's headroom must keep.
UTIL_TARGET = 0.95


@dataclass
class OverlapSettings:
    rows: str = DEFAULT_ROWS  # WIRE@RATE,...: the wire format and every node's link rate per row
    nodes: int = 4
    cpu: str = "0.45"
    preset: str = "small"
    sync_every: int = 10
    overlap_steps: int = 1
    budget_s: float = 300.0
    name: str = "ovl-bench"
    out: str | None = None


def parse_rows(text: str) -> list[tuple[str, str]]:
    """`int8@100mbit,bf16@100mbit` -> [("int8", "100mbit"), ("bf16", "100mbit")]."""
    from vpscluster.errors import UserError
    from vpscluster.units import parse_rate_mbit

    rows = []
    for item in (s.strip() for s in text.split(",") if s.strip()):
        wire, _, rate = item.partition("@")
        if wire not in sync_rule.WIRES or not rate:
            raise UserError(f"--rows: {item!r} is not WIRE@RATE; write e.g. int8@100mbit (wires: {', '.join(sync_rule.WIRES)})")
        parse_rate_mbit(rate, "--rows")
        rows.append((wire, rate))
    if not rows:
        raise UserError("--rows: give at least one WIRE@RATE, e.g. int8@100mbit")
    return rows


def run_overlap(settings: OverlapSettings, say: Callable[[str], None] = lambda line: None) -> dict[str, Any]:
    from vpscluster.cluster import sandbox
    from vpscluster.errors import RemoteError, UserError
    from vpscluster.train.presets import get_preset
    from vpscluster.units import parse_rate_mbit

    s = settings
    rows = parse_rows(s.rows)
    if s.sync_every < 2 or not 1 <= s.overlap_steps < s.sync_every or s.budget_s <= 0 or s.nodes < 2:
        raise UserError("--sync-every must be at least 2, --overlap-steps 1 to H - 1, --budget-s positive, --nodes >= 2")
    shape = get_preset(s.preset)
    params = shape.num_params()
    # bench wan's row runner, without evaluations (they would only pause the training it times)
    wan = WanSettings(nodes=s.nodes, cpu=s.cpu, preset=s.preset, budget_s=s.budget_s, sync_every=s.sync_every,
                      diloco_eval_every=BIG_STEPS, strategies="baseline").resolved()
    out = Path(s.out or Path("bench") / "results" / time.strftime("overlap-%Y%m%d-%H%M%S", time.gmtime())).resolve()
    out.mkdir(parents=True, exist_ok=True)
    started, load_start = time.time(), os.getloadavg()[0]
    say(f"sandbox {s.name}: {s.nodes} nodes, CPU {s.cpu} each; DiLoCo H={s.sync_every}, τ={s.overlap_steps}")
    info = sandbox.up(s.name, nodes=s.nodes, bandwidth=rows[0][1], cpu=s.cpu, progress=lambda m: say(f"  {m}"))
    results: list[dict[str, Any]] = []
    try:
        for wire, rate in rows:
            name = f"{wire}-{rate}"
            mbit = parse_rate_mbit(rate, "--rows")
            for node in info.nodes:
                sandbox.set_rate(s.name, node.name, rate)
            say(f"{name}: training ({s.budget_s:g} s budget; log {out / name}.log)")
            flags = ["--strategy", "diloco", "--sync-every", "{H}", "--wire-dtype", wire,
                     "--overlap-steps", str(s.overlap_steps)]
            sync_s = sync_rule.sync_seconds(params, s.nodes, wire, mbit * 1e6 / 8)
            row = {"row": name, "wire": wire, "mbit": mbit, "sync_mb": sync_rule.sync_bytes(params, s.nodes, wire) / 1e6,
                   "sync_s": sync_s}
            try:
                r = _run_train(wan, info, name, flags, out)
            except (RemoteError, subprocess.TimeoutExpired, OSError, ValueError, KeyError) as e:
                row["failed"] = str(e).splitlines()[0][:300]
                say(f"  {name} failed: {row['failed']}")
                results.append(row)
                continue
            d = r["strategy"] or {}
            step_s = r["compute_s_per_step"]
            ratio = sync_s / (s.overlap_steps * step_s)
            row.update(step_s=step_s, ratio=ratio, hidden="yes" if ratio <= sync_rule.OVERLAP_HEADROOM else "no",
                       busy_s=d.get("collective_busy_seconds", 0.0) / max(1, d.get("outer_syncs", 0)),
                       steps=r["steps"], tokens_per_s=r["tokens_per_s"], util=r["compute_utilization"],
                       util_wall=r["compute_utilization_of_wall"])
            results.append(row)
            (out / f"{name}.json").write_text(json.dumps(r, indent=1))
            say(f"  {name}: sync {ratio:.2f} of {s.overlap_steps} step(s), utilisation {row['util']:.1%}")
    finally:
        try:
            sandbox.down(s.name)
        except OSError as e:
            say(f"warning: sandbox {s.name} teardown: {e}")
    doc = {
        "command": "vpscluster bench overlap " + " ".join(f"--{k.replace('_', '-')} {getattr(s, k)}" for k in (
            "rows", "nodes", "cpu", "preset", "sync_every", "overlap_steps", "budget_s")),
        "headroom": sync_rule.OVERLAP_HEADROOM, "machine": {**_machine(), "os": page.os_name()}, "rows": results,
        "results_dir": str(out), "started": started, "ended": time.time(),
        "load_average": {"start": load_start, "end": os.getloadavg()[0]},
    }
    (out / "results.json").write_text(json.dumps(doc, indent=1))
    (out / "table.md").write_text(markdown_table(results) + "\n")
    return doc


def cell(row: dict[str, Any], key: str, fmt: str) -> str:
    return table.cell(row, key, fmt, name_key="row")


def markdown_table(rows: list[dict[str, Any]]) -> str:
    return table.markdown(rows, COLUMNS, cell)


def front_row(doc: dict[str, Any], command: str) -> tuple[str, ...]:
    """The overlap row of BENCHMARKS.md's front table: utilisation per sync length, and whether
    every row the rule counts as hidden kept `UTIL_TARGET`."""
    headroom = doc.get("headroom", sync_rule.OVERLAP_HEADROOM)
    rows = doc["rows"]
    ok = [r for r in rows if not r.get("failed")]
    result = "; ".join(f"{r['row']} failed" if r.get("failed") else f"{r['row']} {r['util']:.1%} at {r['ratio']:.2f}"
                       for r in rows)
    result = "utilisation (at the sync's length ÷ τ steps): " + (result or "no rows")
    within = [r for r in ok if r["ratio"] <= headroom]
    low = [r for r in within if r["util"] < UTIL_TARGET]
    if not ok:
        met = "—: no row finished"
    elif not within:
        met = f"—: no row's sync within the {headroom:.0%} headroom"
    elif low:
        met = "**missed**: " + ", ".join(f"{r['row']} ({r['ratio']:.2f} of a step) gave {r['util']:.1%}" for r in low)
    else:
        met = f"**met**: every row within the {headroom:.0%} headroom kept ≥ {UTIL_TARGET:.0%}"
    if ok and len(ok) < len(rows):
        met += f" ({len(rows) - len(ok)} row(s) failed)"
    target = (f"none of its own: at the rule's {headroom:.0%} headroom, utilisation ≥ {UTIL_TARGET:.0%} "
              "(issue 16's target)")
    load = doc.get("load_average") or {}
    machine = page.machine_line(doc.get("machine") or {}, (load["start"], load["end"]) if load else None)
    return (target, result, met, page.utc_span(doc["started"], doc["ended"]), f"`{command}`", machine)


def benchmarks_block(doc: dict[str, Any], command: str) -> str:
    """What `--update-benchmarks` writes between BENCHMARKS.md's overlap markers."""
    return page.table([front_row(doc, command)]) + "\n\n" + markdown_table(doc["rows"])
