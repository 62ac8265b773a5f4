"""The uneven-nodes benchmark: balanced shares against an even split, on uneven sandbox CPUs.

    run_uneven(UnevenSettings(...), say=print) -> results document   (CLI: `vpscluster bench uneven`)

One sandbox with fast links (compute, not the network, is the limit). Its nodes' CPU quotas are
changed live between runs (`sandbox.set_cpu`), so every run uses the same nodes. For each
strategy (ddp, diloco), under the same wall-clock training budget:

- `even`:       the same total CPU spread evenly over the nodes, shares even (the ideal);
- `uneven`:     the uneven quotas (e.g. 0.6,0.3,0.15), shares even, no balancing;
- `balanced`:   the uneven quotas with `--balance` (shares learned from measured speeds);
- `even2`:      the `even` run again, last of all (after the change runs). The yardstick is the
                mean of the two: on this shared machine a sandbox's first run was up to 20% slower
                than the same run minutes later (ABBA, 2026-12-04), which flattered the others.

Then `change`, per strategy: the uneven quotas, balanced, and node 1's quota drops to a third at
a known step and comes back later. The figure is how soon throughput is back within 90% of the
new ideal (the even yardstick's tokens/s scaled by the total CPU now available): for ddp, the steps
until tokens/s over a 3-step window gets there; for DiLoCo, whose steps differ within a round
(the sync's work lands on some), the rounds: the first whole round (H steps, aligned to the
syncs) after the one the change fell in is round 1. DiLoCo's balancer looks at round ends
(`shares.look_every`), so "1" means the look right after the change re-split well enough.

Per run: tokens/s (and as % of the even yardstick; also over the second half of the steps, after start-up
and the first re-splits), compute utilisation per rank (compute / (compute +
communication)), final shares and rebalances, validation loss at the `even` run's token count.
Results: `out` (default bench/results/uneven-<time>/): results.json, table.md, every run's files.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from vpscluster.bench import table
from vpscluster.bench.run_events import RunEvents
from vpscluster.bench.wan import BIG_STEPS, _cli, _machine, evals_from_metrics, loss_at_tokens
from vpscluster.train.strategies import STRATEGIES, costs_for

MODES = ("even", "uneven", "balanced")


@dataclass
class UnevenSettings:
    cpu: str = "0.6,0.3,0.15"  # uneven quotas, one per node
    bandwidth: str = "1gbit"
    preset: str = "tiny"
    batch_size: int = 2  # sequences per micro-batch
    micro_batches: int = 12  # per step, in all
    budget_s: float = 90.0
    strategies: str = "ddp,diloco"
    sync_every: int = 10
    rebalance_every: int = 5
    eval_every: int = 10
    change_steps: str = "30,70"  # drop node 1 to a third at the first step, back at the second
    change_max_steps: int = 110
    name: str = "ue-bench"
    out: str | None = None


def run_uneven(settings: UnevenSettings, say: Callable[[str], None] = lambda line: None) -> dict[str, Any]:
    from vpscluster.cluster import sandbox
    from vpscluster.errors import RemoteError, UserError

    s = settings
    quotas = [float(v) for v in s.cpu.split(",")]
    if len(quotas) < 2:
        raise UserError("--cpu: give one uneven share per node, e.g. 0.6,0.3,0.15")
    strategies = [v.strip() for v in s.strategies.split(",") if v.strip()]
    if any(v not in STRATEGIES for v in strategies) or not strategies:
        raise UserError(f"--strategies: choose from {', '.join(STRATEGIES)} (got {s.strategies!r})")
    drop, back = (int(v) for v in s.change_steps.split(","))
    if not 0 < drop < back < s.change_max_steps:
        raise UserError("--change-steps DROP,BACK must satisfy 0 < DROP < BACK < --change-max-steps")
    n, total_cpu = len(quotas), sum(quotas)
    even_q = [total_cpu / n] * n
    out = Path(s.out or Path("bench") / "results" / time.strftime("uneven-%Y%m%d-%H%M%S", time.gmtime())).resolve()
    out.mkdir(parents=True, exist_ok=True)
    say(f"sandbox {s.name}: {n} nodes x {s.bandwidth}, CPU {s.cpu} (even: {total_cpu / n:.3g} each)")
    info = sandbox.up(s.name, nodes=n, bandwidth=s.bandwidth, cpu=s.cpu, progress=lambda m: say(f"  {m}"))
    runs: dict[str, dict[str, Any]] = {}
    failed: dict[str, str] = {}

    def attempt(name: str, node_quotas: list[float], start: str, go: Callable[[], dict[str, Any]]) -> bool:
        """Set the nodes' quotas, announce, run; a failed run is recorded in `failed`."""
        for node, q in zip(info.nodes, node_quotas):
            sandbox.set_cpu(s.name, node.name, q)
        say(start)
        try:
            runs[name] = go()
            return True
        except (RemoteError, subprocess.TimeoutExpired, OSError, ValueError, KeyError) as e:
            failed[name] = str(e).splitlines()[0][:300]
            return False

    try:
        for strategy in strategies:
            for mode in MODES:
                name = f"{strategy}-{mode}"
                if not attempt(name, even_q if mode == "even" else quotas, f"{name}: training ({s.budget_s:g} s budget)",
                               lambda: _run(s, info, strategy, mode == "balanced", out / name, budget=True)):
                    say(f"  {name} failed: {failed[name]}")
                    continue
                r = runs[name]
                say(f"  {name}: {r['tokens_per_s']:.0f} tok/s, shares {r.get('shares')}, {r.get('rebalances', 0)} rebalance(s)")
        for strategy in strategies:
            if f"{strategy}-even" in runs:
                name = f"{strategy}-change"
                attempt(name, quotas, f"{name}: balanced {strategy}, {info.nodes[1].name} to a third of its CPU "
                        f"at step {drop}, back at {back}",
                        lambda: _run_change(s, info, strategy, quotas, drop, back, out / name, say))
        for strategy in strategies:  # the yardstick again, last: drift over the bench shows in it
            name = f"{strategy}-even2"
            if attempt(name, even_q, f"{name}: training ({s.budget_s:g} s budget)",
                       lambda: _run(s, info, strategy, False, out / name, budget=True)):
                say(f"  {name}: {runs[name]['tokens_per_s']:.0f} tok/s")
    finally:
        try:
            sandbox.down(s.name)
        except OSError as e:
            say(f"warning: sandbox {s.name} teardown: {e}")
    rows = compare(runs, quotas, drop, back, s.sync_every) + [{"run": k, "failed": v} for k, v in failed.items()]
    doc = {
        "command": "vpscluster bench uneven " + " ".join(f"--{k.replace('_', '-')} {getattr(s, k)}" for k in (
            "cpu", "bandwidth", "preset", "batch_size", "micro_batches", "budget_s", "strategies", "sync_every",
            "rebalance_every", "change_steps")),
        "machine": _machine(), "rows": rows, "results_dir": str(out),
    }
    (out / "results.json").write_text(json.dumps(doc, indent=1))
    (out / "table.md").write_text(markdown_table(rows) + "\n")
    return doc


def _argv(s: UnevenSettings, info, strategy: str, balance: bool, run_dir: Path) -> list[str]:
    argv = ["train", "--cluster", info.cluster_file, "--preset", s.preset, "--strategy", strategy,
            "--batch-size", str(s.batch_size), "--micro-batches", str(s.micro_batches),
            "--rebalance-every", str(s.rebalance_every), "--eval-every", str(s.eval_every),
            "--checkpoint-every", str(s.sync_every * BIG_STEPS), "--run-dir", str(run_dir), "--json",
            "--max-restarts", "0"]  # a row measures one launch: a failure ends it (recovery is on by default)
    if costs_for(strategy).takes("sync_every"):
        argv += ["--sync-every", str(s.sync_every)]
    if balance:
        argv.append("--balance")
    return argv


def _run(s: UnevenSettings, info, strategy: str, balance: bool, run_dir: Path, budget: bool) -> dict[str, Any]:
    argv = _argv(s, info, strategy, balance, run_dir) + ["--time-budget", str(s.budget_s), "--max-steps", str(BIG_STEPS)]
    report = json.loads(_cli(argv, run_dir.with_suffix(".log"), s.budget_s + 900).stdout)
    return _summary(report, run_dir)


def _summary(report: dict[str, Any], run_dir: Path) -> dict[str, Any]:
    ranks = report["per_rank"]
    return {
        "steps": report["steps"], "tokens": report["tokens"], "tokens_per_s": report["tokens_per_s"],
        "utilization_per_rank": [r["compute_seconds"] / max(1e-9, r["compute_seconds"] + r["comm_seconds"]) for r in ranks],
        "final_val_loss": report["final_val_loss"], "shares": report.get("shares"),
        "rebalances": report.get("rebalances", 0), "share_history": report.get("share_history"),
        "evals": evals_from_metrics(run_dir / "metrics.jsonl"),
        "metrics": [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()],
    }


def _run_change(s: UnevenSettings, info, strategy: str, quotas, drop: int, back: int, run_dir: Path,
                say) -> dict[str, Any]:
    from vpscluster.cluster import sandbox

    argv = _argv(s, info, strategy, True, run_dir) + ["--max-steps", str(s.change_max_steps)]
    log = run_dir.with_suffix(".log")
    with log.open("w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "vpscluster", *argv], stdout=subprocess.PIPE, stderr=err, text=True)
        try:
            node, events = info.nodes[1].name, RunEvents(run_dir)
            for at, q in ((drop, quotas[1] / 3), (back, quotas[1])):
                while proc.poll() is None and events.step < at:
                    time.sleep(0.2)
                    events.poll()
                sandbox.set_cpu(s.name, node, max(0.05, q))
                say(f"  step {events.step}: {node} CPU {max(0.05, q):.3g}")
            stdout, _ = proc.communicate(timeout=3600)
        finally:
            if proc.poll() is None:
                proc.kill()
    if proc.returncode != 0:
        raise OSError(f"the change run failed; log: {log}")
    return _summary(json.loads(stdout), run_dir)


def steps_to_recover(metrics: list[dict[str, Any]], start: int, end: int, ideal_tps: float, window: int = 3) -> int | None:
    """Steps after `start` until tokens/s over a `window`-step window is >= 90% of `ideal_tps`."""
    steps = [m for m in metrics if "loss" in m and start < m["step"] <= end]
    for i in range(len(steps) - window + 1):
        w = steps[i : i + window]
        if sum(m["tokens"] for m in w) / sum(m["step_seconds"] for m in w) >= 0.9 * ideal_tps:
            return w[-1]["step"] - start
    return None


def rounds_to_recover(metrics: list[dict[str, Any]], start: int, end: int, ideal_tps: float, every: int) -> int | None:
    """DiLoCo: whole rounds (steps k*every+1 .. (k+1)*every) after the round that holds step
    `start`+1 (where the change fell), until a round's tokens/s is >= 90% of `ideal_tps`; the
    first whole round after the change's round is 1. Rounds reaching past `end` are not counted."""
    by_step = {m["step"]: m for m in metrics if "loss" in m}
    end = min(end, max(by_step, default=0))
    k = start // every + 1  # the first round that begins after the change's round
    while (k + 1) * every <= end:
        steps = [by_step.get(t) for t in range(k * every + 1, (k + 1) * every + 1)]
        if all(steps):
            if sum(m["tokens"] for m in steps) / sum(m["step_seconds"] for m in steps) >= 0.9 * ideal_tps:
                return k - start // every
        k += 1
    return None


def steady_tokens_per_s(metrics: list[dict[str, Any]]) -> float | None:
    """Tokens/s over the second half of a run's steps: after start-up and the first re-splits
    (a short run's report figure is dominated by them)."""
    steps = [m for m in metrics if "loss" in m]
    half = steps[len(steps) // 2 :]
    seconds = sum(m["step_seconds"] for m in half)
    return sum(m["tokens"] for m in half) / seconds if seconds > 0 else None


def yardstick(runs: dict[str, dict[str, Any]], strategy: str) -> tuple[float | None, float | None]:
    """(tokens/s, tokens/s over the second half) of the even spread: the mean of the `even` run
    and its repeat `even2`, whichever exist."""
    evens = [runs[k] for k in (f"{strategy}-even", f"{strategy}-even2") if k in runs]
    steady = [v for v in (steady_tokens_per_s(e["metrics"]) for e in evens) if v]
    return (sum(e["tokens_per_s"] for e in evens) / len(evens) if evens else None,
            sum(steady) / len(steady) if steady else None)


def compare(runs: dict[str, dict[str, Any]], quotas: list[float], drop: int, back: int,
            sync_every: int) -> list[dict[str, Any]]:
    rows = []
    for name, r in runs.items():
        strategy = name.split("-")[0]
        even = runs.get(f"{strategy}-even")
        even_tps, even_steady = yardstick(runs, strategy)
        steady = steady_tokens_per_s(r["metrics"])
        row = {"run": name, "steps": r["steps"], "tokens_per_s": r["tokens_per_s"],
               "pct_of_even": 100 * r["tokens_per_s"] / even_tps if even_tps else None,
               "steady_tokens_per_s": steady,
               "steady_pct_of_even": 100 * steady / even_steady if steady and even_steady else None,
               "utilization": "/".join(f"{u:.0%}" for u in r["utilization_per_rank"]),
               "shares": ":".join(str(v) for v in r["shares"]) if r.get("shares") else None,
               "rebalances": r.get("rebalances"), "final_val_loss": r["final_val_loss"],
               "val_at_even_tokens": loss_at_tokens(r["evals"], even["tokens"]) if even and not name.endswith("-change") else None}
        if even and r["evals"] and even["evals"] and name != f"{strategy}-even":
            # Same mathematics: validation loss against the even run's at the tokens both reached.
            tokens = min(r["evals"][-1]["tokens"], even["evals"][-1]["tokens"])
            mine, theirs = loss_at_tokens(r["evals"], tokens), loss_at_tokens(even["evals"], tokens)
            if mine is not None and theirs:
                row["val_vs_even_pct"] = 100 * (mine - theirs) / theirs
        if name.endswith("-change") and even_tps:
            total = sum(quotas)
            low = (total - quotas[1] * 2 / 3) / total
            if costs_for(strategy).takes("sync_every"):  # shares move at syncs: count whole rounds
                row["rounds_to_90pct_after_drop"] = rounds_to_recover(r["metrics"], drop, back, even_tps * low, sync_every)
                row["rounds_to_90pct_after_recovery"] = rounds_to_recover(r["metrics"], back, 10**9, even_tps, sync_every)
            else:
                row["steps_to_90pct_after_drop"] = steps_to_recover(r["metrics"], drop, back, even_tps * low)
                row["steps_to_90pct_after_recovery"] = steps_to_recover(r["metrics"], back, 10**9, even_tps)
        rows.append(row)
    return rows


COLUMNS = [("run", "run", "{}"), ("steps", "steps", "{}"), ("tokens_per_s", "tok/s", "{:.0f}"),
           ("pct_of_even", "% of even", "{:.0f}%"), ("steady_tokens_per_s", "tok/s 2nd half", "{:.0f}"),
           ("steady_pct_of_even", "% of even (2nd half)", "{:.0f}%"), ("utilization", "util per rank", "{}"), ("shares", "shares", "{}"),
           ("rebalances", "rebal.", "{}"), ("val_at_even_tokens", "val @even tok", "{:.3f}"),
           ("val_vs_even_pct", "val vs even @equal tok", "{:+.2f}%"),
           ("steps_to_90pct_after_drop", "steps to 90% (drop)", "{}"),
           ("steps_to_90pct_after_recovery", "steps to 90% (back)", "{}"),
           ("rounds_to_90pct_after_drop", "rounds to 90% (drop)", "{}"),
           ("rounds_to_90pct_after_recovery", "rounds to 90% (back)", "{}")]


def cell(row, key, fmt) -> str:
    return table.cell(row, key, fmt, name_key="run")


def markdown_table(rows: list[dict[str, Any]]) -> str:
    return table.markdown(rows, COLUMNS, cell)
