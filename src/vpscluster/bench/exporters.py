"""The exporters' cost: tokens/s of the same training run with and without them, side by side.

    run_exporters(ExporterSettings(...), say=print) -> results document   (CLI: `vpscluster bench exporters`)

The reference scenario of `bench wan` (4 sandbox nodes, 100 Mbit/s links, 0.45 CPU each,
`small`), one fixed strategy (DiLoCo, H = --sync-every: mostly compute, so the exporters' CPU
shows). Runs "with": `monitor up` (a real Prometheus on the head and the node exporters, scraping
every `scrape_interval_s`) and the ranks' exporters; runs "without": `monitor down` and
`train --no-exporters`, so nothing of the monitoring runs. Runs alternate in ABBA order
(`pairs` times on/off/off/on) so a drift of the machine's speed falls on both sides alike; the
spread within each side is the noise floor a difference must clear.

That noise (several % between identical runs on a shared machine) is far above the 1% a cost
should stay under, so each "with" run also counts the monitoring's CPU directly: Prometheus's
and the node exporters' CPU seconds during the run (their processes' utime + stime, read on this
machine: sandbox nodes share its pid space) plus every rank's `exporter_cpu_seconds` (metric
updates and scrapes served, from the report), against the CPU the nodes' quotas give the run
(sum of quotas x training seconds). On CPU-bound nodes that share is what the monitoring takes
from training. Results: `out` (default bench/results/exporters-<time>/): results.json, table.md,
every run's files.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from vpscluster.bench import table
from vpscluster.bench.uneven import steady_tokens_per_s
from vpscluster.bench.wan import BIG_STEPS, _cli, _machine
from vpscluster.probe.node_exporter import proc_cpu_seconds


@dataclass
class ExporterSettings:
    nodes: int = 4
    bandwidth: str = "100mbit"
    cpu: str = "0.45"
    preset: str = "small"
    sync_every: int = 20
    budget_s: float = 120.0
    pairs: int = 2  # ABBA blocks: each runs with exporters twice and without twice
    scrape_interval_s: float = 5.0
    name: str = "exporters-bench"
    out: str | None = None


def run_exporters(settings: ExporterSettings, say: Callable[[str], None] = lambda line: None) -> dict[str, Any]:
    from vpscluster.cluster import sandbox
    from vpscluster.errors import RemoteError, UserError

    s = settings
    if s.pairs < 1 or s.budget_s <= 0:
        raise UserError("--pairs must be >= 1 and --budget-s > 0")
    out = Path(s.out or Path("bench") / "results" / time.strftime("exporters-%Y%m%d-%H%M%S", time.gmtime())).resolve()
    out.mkdir(parents=True, exist_ok=True)
    order = ["on", "off", "off", "on"] * s.pairs
    say(f"sandbox {s.name}: {s.nodes} nodes x {s.bandwidth}, CPU {s.cpu}; {len(order)} runs of {s.budget_s:g} s ({' '.join(order)})")
    info = sandbox.up(s.name, nodes=s.nodes, bandwidth=s.bandwidth, cpu=s.cpu, progress=lambda m: say(f"  {m}"))
    rows: list[dict[str, Any]] = []
    monitoring = [False]
    quota_cores = quota_sum(s.cpu, s.nodes)

    def monitor(want: bool, i: int) -> None:  # on: Prometheus and the node exporters run; off: nothing does
        if want != monitoring[0]:
            verb = "up" if want else "down"
            extra = ["--scrape-interval", str(s.scrape_interval_s), "--json"] if want else []
            _cli(["monitor", verb, "--cluster", info.cluster_file, *extra], out / f"monitor-{verb}-{i:02d}.log", 300)
            monitoring[0] = want

    try:
        for i, mode in enumerate(order, 1):
            monitor(mode == "on", i)
            run_dir = out / f"{i:02d}-{mode}"
            argv = ["train", "--cluster", info.cluster_file, "--preset", s.preset, "--strategy", "diloco",
                    "--sync-every", str(s.sync_every), "--wire-dtype", "fp32", "--time-budget", str(s.budget_s), "--max-steps", str(BIG_STEPS),
                    "--eval-every", str(BIG_STEPS), "--checkpoint-every", str(BIG_STEPS), "--run-dir", str(run_dir), "--json",
                    "--max-restarts", "0"]  # a row measures one launch (recovery is on by default)
            if mode == "off":
                argv.append("--no-exporters")
            pids = monitor_pids(info.cluster_file) if mode == "on" else []
            before = {p: proc_cpu_seconds(p) for p in pids}
            try:
                report = json.loads(_cli(argv, run_dir.with_suffix(".log"), s.budget_s + 900).stdout)
            except (RemoteError, subprocess.TimeoutExpired, OSError, ValueError) as e:
                rows.append({"run": f"{i:02d}", "exporters": mode, "failed": str(e).splitlines()[0][:300]})
                say(f"  run {i} ({mode}) failed: {rows[-1]['failed']}")
                continue
            metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
            rows.append({"run": f"{i:02d}", "exporters": mode, "steps": report["steps"],
                         "tokens_per_s": report["tokens_per_s"], "steady_tokens_per_s": steady_tokens_per_s(metrics),
                         "wall_seconds": report["wall_seconds"],
                         **(monitoring_cpu(before, {p: proc_cpu_seconds(p) for p in pids}, report, quota_cores)
                            if mode == "on" else {})})
            say(f"  run {i} (exporters {mode}): {report['tokens_per_s']:.0f} tokens/s")
    finally:
        try:
            monitor(False, 0)
        except (RemoteError, subprocess.TimeoutExpired, OSError) as e:
            say(f"warning: monitor down: {e}")
        sandbox.down(s.name)
    doc = {"command": "vpscluster bench exporters " + " ".join(
        f"--{k.replace('_', '-')} {getattr(s, k)}" for k in ("nodes", "bandwidth", "cpu", "preset", "sync_every", "budget_s",
                                                              "pairs", "scrape_interval_s")),
           "machine": _machine(), "rows": rows, "summary": summarize(rows),
           "summary_steady": summarize(rows, "steady_tokens_per_s"), "results_dir": str(out)}
    (out / "results.json").write_text(json.dumps(doc, indent=1))
    (out / "table.md").write_text(markdown(rows, doc["summary"], doc["summary_steady"]) + "\n")
    return doc


def quota_sum(cpu: str, nodes: int) -> float:
    """The cores the nodes' quotas add up to: "0.45" for every node, or one figure per node."""
    parts = [float(x) for x in str(cpu).split(",") if x.strip()]
    return parts[0] * nodes if len(parts) == 1 else sum(parts)


def monitor_pids(cluster_file: str) -> list[int]:
    """Prometheus's and the node exporters' pids, from `monitor up`'s record of the cluster."""
    from vpscluster.cluster.inventory import load_cluster
    from vpscluster.monitor.server import load_record

    rec = load_record(load_cluster(cluster_file))
    if rec is None:
        return []
    return [rec.prometheus_pid, *(int(e["pid"]) for e in rec.node_exporters.values() if e.get("pid"))]


def monitoring_cpu(before: dict[int, float | None], after: dict[int, float | None], report: dict[str, Any],
                   quota_cores: float) -> dict[str, Any]:
    """The monitoring's CPU seconds during one run and their share of the CPU the quotas gave it.
    A process that was not there at both ends is not counted (and the row says how many were)."""
    servers = [after[p] - before[p] for p in before if before[p] is not None and after.get(p) is not None]
    ranks = [r.get("exporter_cpu_seconds") for r in report.get("per_rank", [])]
    ranks_s = sum(v for v in ranks if isinstance(v, (int, float)))
    total = sum(servers) + ranks_s
    budget = quota_cores * report["wall_seconds"]
    return {"monitor_processes": f"{len(servers)}/{len(before)}", "servers_cpu_s": sum(servers),
            "exporters_cpu_s": ranks_s, "monitoring_cpu_pct": 100 * total / budget if budget > 0 else None}


def summarize(rows: list[dict[str, Any]], key: str = "tokens_per_s") -> dict[str, Any]:
    """Mean tokens/s with and without exporters, the cost in %, and each side's spread (from the
    runs' `key`: the report's tokens/s, or `steady_tokens_per_s` over the second half of steps)."""
    side = {m: [r[key] for r in rows if r.get("exporters") == m and r.get(key)] for m in ("on", "off")}
    if not side["on"] or not side["off"]:
        return {"runs_on": len(side["on"]), "runs_off": len(side["off"])}
    on, off = statistics.mean(side["on"]), statistics.mean(side["off"])

    def spread(v: list[float]) -> float:
        return 100 * (max(v) - min(v)) / statistics.mean(v)

    cpu = [r["monitoring_cpu_pct"] for r in rows if r.get("exporters") == "on" and r.get("monitoring_cpu_pct") is not None]
    return {"runs_on": len(side["on"]), "runs_off": len(side["off"]), "tokens_per_s_on": on, "tokens_per_s_off": off,
            "cost_pct": 100 * (off - on) / off, "spread_on_pct": spread(side["on"]), "spread_off_pct": spread(side["off"]),
            "monitoring_cpu_pct": statistics.mean(cpu) if cpu else None,
            "monitoring_cpu_pct_max": max(cpu) if cpu else None}


COLUMNS = [("run", "run", "{}"), ("exporters", "exporters", "{}"), ("steps", "steps", "{}"),
           ("tokens_per_s", "tokens/s", "{:.1f}"), ("steady_tokens_per_s", "tokens/s 2nd half", "{:.1f}"),
           ("wall_seconds", "training s", "{:.1f}"), ("servers_cpu_s", "Prometheus + node exporters CPU s", "{:.2f}"),
           ("exporters_cpu_s", "rank exporters CPU s", "{:.2f}"), ("monitoring_cpu_pct", "monitoring CPU % of quota", "{:.2f}")]


def markdown(rows: list[dict[str, Any]], summary: dict[str, Any], steady: dict[str, Any] | None = None) -> str:
    text = table.markdown(rows, COLUMNS, lambda r, k, f: table.cell(r, k, f, name_key="run"))
    for what, sm in (("tokens/s", summary), ("tokens/s over the 2nd half", steady or {})):
        if "cost_pct" in sm:
            text += (f"\n\n{what}: with exporters {sm['tokens_per_s_on']:.1f}, without {sm['tokens_per_s_off']:.1f}: "
                     f"cost {sm['cost_pct']:+.2f}% (spread within each side: {sm['spread_on_pct']:.1f}% with, "
                     f"{sm['spread_off_pct']:.1f}% without)")
    if summary.get("monitoring_cpu_pct") is not None:
        text += (f"\n\nmonitoring CPU, counted: {summary['monitoring_cpu_pct']:.2f}% of the nodes' CPU quota on average "
                 f"(at most {summary['monitoring_cpu_pct_max']:.2f}% in one run)")
    return text
