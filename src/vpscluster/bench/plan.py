"""The plan benchmark: plan's predictions against measured step and communication time.

    run_plan_bench(PlanBenchSettings(...), say=print) -> results document   (CLI: `vpscluster bench plan`)

For each sandbox scenario (2-4 nodes, 20 Mbit/s-1 Gbit/s, CPU shares 0.3-0.9, some uneven):

1. `sandbox up`, then `vpscluster probe --cluster FILE` (the measured facts: FLOP/s, link
   matrix, all-reduce sweep);
2. the plan for each strategy from that probe and each node's step time on the planned model
   (`plan --calibrate`: every node of the scenario runs a few forward/backward/AdamW steps of
   the model at its real shape and thread count, warm-up discarded, median of repeats —
   `plan/steptime.py`; measured once per scenario, cached for its second strategy); no
   distributed run feeds it;
3. a short real training run, `vpscluster train --cluster FILE` (ddp, and diloco with a small H
   so the run holds whole rounds), and rank 0's per-step metrics after a warm-up;
4. predicted vs measured for rank 0's node: mean step seconds, mean communication seconds; and
   the run's own online correction (report.json's `prediction`: the compute term rescaled from
   the first steps after the warm-up, judged on the steps after them).

Nothing measured in a training run feeds the plan's prediction. The table, with the median and
maximum absolute relative errors, goes to bench/results/ and to the `plan` section of
BENCHMARKS.md (both under the current folder unless the settings say otherwise).
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from vpscluster.train.strategies import costs_for

SANDBOX = "planbench"
# One torch thread per rank: on a shared 2-core machine, two OpenMP threads per rank stall at
# every barrier whenever another process holds a core, which is noise, not the model's cost.
THREADS = 1
RESULTS_DIR = Path("bench/results")
MARK_START = "<!-- section: plan (vpscluster bench plan) -->"
MARK_END = "<!-- end: plan -->"


@dataclass(frozen=True)
class Scenario:
    nodes: int
    bandwidth: str  # one rate or one per node, as `sandbox up --bandwidth`
    cpu: str  # one share or one per node
    model: str
    strategies: tuple[str, ...] = ("ddp", "diloco")

    def label(self) -> str:
        return f"{self.nodes}n {self.bandwidth} cpu {self.cpu} {self.model}"


# 6 sandboxes x 2 strategies = 12 configurations; CPU shares sum to at most 1.8 of this
# machine's 2 cores so the sandbox itself is not oversubscribed.
SCENARIOS = (
    Scenario(2, "20mbit", "0.6", "tiny"),
    Scenario(2, "1gbit", "0.9,0.3", "small"),
    Scenario(3, "100mbit", "0.45", "small"),
    Scenario(3, "200mbit,500mbit,1gbit", "0.5", "tiny"),
    Scenario(4, "50mbit", "0.45,0.45,0.3,0.3", "tiny"),
    Scenario(4, "100mbit", "0.45", "small"),
)
QUICK = (Scenario(2, "100mbit", "0.5", "tiny"),)


@dataclass
class PlanBenchSettings:
    quick: bool = False  # one small scenario (a smoke test), never written to BENCHMARKS.md
    # training steps per ddp run (diloco runs 3 rounds after a warm-up round); enough for the
    # trainer's warm-up and correction window (train/prediction.py) and steps after them
    steps: int = 14
    sync_every: int = 3  # diloco H in the short runs
    write: bool = True  # update the plan section of `benchmarks`
    benchmarks: str = "BENCHMARKS.md"
    results_dir: str = str(RESULTS_DIR)
    name: str = SANDBOX  # the sandbox's name (unique per user of a shared machine)


def run_plan_bench(settings: PlanBenchSettings, say: Callable[[str], None] = lambda line: None) -> dict:
    """Every scenario: sandbox, probe, plan, short real runs; the results document."""
    from vpscluster.cluster import sandbox
    from vpscluster.errors import UserError

    args = settings
    if args.steps < 4 or args.sync_every < 1:
        raise UserError("--steps must be at least 4 and --sync-every at least 1")
    benchmarks = Path(args.benchmarks)
    if args.write and not args.quick and not benchmarks.is_file():
        raise UserError(f"{benchmarks}: no such file to write the plan section into; run from the project "
                        "folder, pass --benchmarks FILE, or --no-write")
    scenarios = QUICK if args.quick else SCENARIOS
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    work = Path(args.results_dir) / f"plan-{stamp}"
    work.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    started = time.time()
    load_start = os.getloadavg()[0]
    total = sum(len(s.strategies) for s in scenarios)
    for i, sc in enumerate(scenarios):
        sandbox.down(args.name)  # a leftover from an interrupted run
        try:
            info = sandbox.up(args.name, nodes=sc.nodes, bandwidth=sc.bandwidth, cpu=sc.cpu)
            probe_file = work / f"s{i}-probe.json"
            say(f"[{len(rows)}/{total}] {sc.label()}: probe")
            _cli(["probe", "--cluster", info.cluster_file, "--out", str(probe_file), "--json"],
                 timeout_s=300)
            for j, strategy in enumerate(sc.strategies):
                say(f"[{len(rows)}/{total}] {sc.label()}: {strategy}" + (" (step times on every node first)" if j == 0 else ""))
                row = _one(sc, strategy, info.cluster_file, probe_file, work / f"s{i}-{strategy}", args,
                           calibrate=j == 0)  # the scenario's nodes, once; its second strategy reads the cache
                rows.append(row)
                say(_row_line(row))
        finally:
            sandbox.down(args.name)
    summary = summarize(rows)
    doc = {"rows": rows, "summary": summary, "seconds": time.time() - started, "machine": _machine(),
           "command": "vpscluster bench plan" + (" --quick" if args.quick else ""), "steps": args.steps,
           "sync_every": args.sync_every, "load_average": {"start": load_start, "end": os.getloadavg()[0]}}
    (work / "results.json").write_text(json.dumps(doc, indent=2) + "\n")
    if not args.quick and args.write:
        write_benchmarks_section(benchmarks, markdown(doc))
    return doc


def _one(sc: Scenario, strategy: str, cluster_file: str, probe_file: Path, run_dir: Path, args, calibrate: bool) -> dict:
    from vpscluster.plan.api import PlanRequest, make_plan

    h = args.sync_every
    rounds = costs_for(strategy).takes("sync_every")  # ranks meet every h steps, not every step
    steps = max(3 * h + h, args.steps) if rounds else args.steps  # a warm-up round, then whole rounds
    steps = -(-steps // h) * h if rounds else steps
    plan = make_plan(PlanRequest(model=sc.model, cluster=cluster_file, probe=str(probe_file), strategy=strategy,
                                 sync_every=h, calibrate=calibrate, tokens=1e6, threads_per_rank=THREADS))
    cfg = run_dir.with_suffix(".yaml")
    cfg.write_text("eval_batches: 1\nwarmup_steps: 2\n")
    report = _cli(["train", "--cluster", cluster_file, "--preset", sc.model, "--strategy", strategy,
                   "--max-steps", str(steps), "--sync-every", str(h), "--checkpoint-every", str(steps),
                   "--eval-every", str(steps), "--threads-per-rank", str(THREADS), "--config", str(cfg), "--run-dir", str(run_dir), "--json",
                   "--max-restarts", "0",  # a row measures one launch (recovery is on by default)
                   "--no-balance"],  # the even split, which the plan predicts (uneven scenarios would balance)
                  timeout_s=900)
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    per_step = [m for m in metrics if "step_seconds" in m]
    # Skip the warm-up (first steps: allocations, connections; for diloco the whole first round).
    first = h + 1 if rounds else 3
    measured = [m for m in per_step if m["step"] >= first]
    rank0 = report.get("rank0_node")
    node = next((n for n in plan["nodes"] if n["name"] == rank0), plan["nodes"][0])
    # The machine is shared: other work stretches some steps' compute several-fold. The median
    # resists those spikes; communication is a mean (DiLoCo's sits in 1 of H steps).
    meas_comm = statistics.fmean(m["comm_seconds"] for m in measured)
    meas_compute = round_median([m["compute_seconds"] for m in measured], h if rounds else 1)
    meas_step = meas_compute + meas_comm
    pred_step, pred_comm = plan["step_seconds"], node["comm_seconds"]
    online = report.get("prediction") or {}
    corr, after = online.get("corrected") or {}, online.get("measured_after_correction") or {}
    return {
        "scenario": sc.label(), "nodes": sc.nodes, "bandwidth": sc.bandwidth, "cpu": sc.cpu, "model": sc.model,
        "strategy": f"{strategy} H={h}" if rounds else strategy, "rank0_node": rank0,
        "steps_measured": len(measured), "efficiency": plan["efficiency"],
        "predicted_step_s": pred_step, "measured_step_s": meas_step, "step_error": _err(pred_step, meas_step),
        "predicted_comm_s": pred_comm, "measured_comm_s": meas_comm, "comm_error": _err(pred_comm, meas_comm),
        "comm_error_of_step": abs(pred_comm - meas_comm) / meas_step,
        "predicted_compute_s": node["compute_seconds"],
        "measured_compute_s": meas_compute,
        "measured_mean_step_s": statistics.fmean(m["step_seconds"] for m in measured),
        "probe_flops": {n["name"]: n["flops"] for n in plan["nodes"]},
        "step_calibration": {name: {k: v[k] for k in ("median_s", "spread", "repeats", "outliers", "threads")}
                             for name, v in ((plan.get("step_calibration") or {}).get("nodes") or {}).items()},
        # The run's online correction (report.json): from its first steps, judged on the rest.
        "corrected_step_s": corr.get("step_seconds"), "measured_after_correction_step_s": after.get("step_seconds"),
        "corrected_step_error": (online.get("corrected_error") or {}).get("step_seconds"),
        "report_step_error": (online.get("error") or {}).get("step_seconds"),
        "run_dir": str(run_dir),
    }


def round_median(values: list[float], per_round: int) -> float:
    """The median over whole rounds of each round's mean (per_round 1: the median step).

    A DiLoCo round's costs are periodic - the step that sends a sync and the one it lands in
    are longer - so the median *step* is not the mean step a run's throughput follows; the
    median of round means is, and it still resists a spike in one round."""
    rounds = [values[i:i + per_round] for i in range(0, len(values) - per_round + 1, per_round)] or [values]
    return statistics.median(statistics.fmean(r) for r in rounds)


def _err(predicted: float, measured: float) -> float:
    return abs(predicted - measured) / measured if measured > 0 else float("inf")


def _cli(argv: list[str], timeout_s: float) -> dict:
    """Run `vpscluster ARGV` and return its JSON document; fail with its last error line."""
    from vpscluster.cluster.executor import last_words
    from vpscluster.errors import UserError

    try:
        proc = subprocess.run([sys.executable, "-m", "vpscluster", *argv], capture_output=True, text=True,
                              timeout=timeout_s, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    except subprocess.TimeoutExpired:
        raise UserError(f"bench plan: `vpscluster {argv[0]}` did not finish in {timeout_s:.0f} s") from None
    if proc.returncode != 0:
        raise UserError(f"bench plan: `vpscluster {' '.join(argv[:3])}` failed: "
                        f"{last_words(proc.stderr, None, proc.returncode)}")
    return json.loads(proc.stdout)


def summarize(rows: list[dict]) -> dict:
    def stats(key):
        values = [r[key] for r in rows]
        return {"median": statistics.median(values), "max": max(values)} if values else {}

    def stats_present(key):
        values = [r[key] for r in rows if r.get(key) is not None]
        return {"median": statistics.median(values), "max": max(values)} if values else {}

    return {"configurations": len(rows), "step_error": stats("step_error"), "comm_error": stats("comm_error"),
            "comm_error_of_step": stats("comm_error_of_step"),
            "corrected_step_error": stats_present("corrected_step_error")}


def _row_line(r: dict) -> str:
    corrected = (f"  corrected {r['corrected_step_s']:.2f}/{r['measured_after_correction_step_s']:.2f}s "
                 f"({r['corrected_step_error']:.0%})" if r.get("corrected_step_error") is not None
                 and r.get("measured_after_correction_step_s") else "")
    return (f"{r['scenario']:<38} {r['strategy']:<11} step {r['predicted_step_s']:.2f}/{r['measured_step_s']:.2f}s "
            f"({r['step_error']:.0%})  comm {r['predicted_comm_s']:.2f}/{r['measured_comm_s']:.2f}s ({r['comm_error']:.0%})"
            + corrected)


def _machine() -> str:
    from vpscluster.nodeside.facts import cpu_model

    return f"{os.cpu_count()} cores ({cpu_model() or 'unknown CPU'}), {platform.system()} {platform.release()}, Python {platform.python_version()}"


def markdown(doc: dict) -> str:
    s = doc["summary"]
    lines = [
        f"Command: `{doc['command']}` ({doc['steps']} ddp steps, diloco H={doc['sync_every']} for 4 rounds; "
        f"took {doc['seconds'] / 60:.0f} min). Machine: {doc['machine']}; load average "
        f"{doc.get('load_average', {}).get('start', 0):.1f} at the start, {doc.get('load_average', {}).get('end', 0):.1f} at the end.",
        "",
        "Predicted (from the probe and each node's step time measured on the model, no distributed run) vs measured on rank 0 after a warm-up: "
        "step = median compute per step (diloco: the median over rounds of each round's mean, as a round's send and "
        "landing steps are longer) + mean communication per step (the median resists other jobs' "
        "spikes on this shared machine; the plain mean step is in bench/results). One torch thread per rank. "
        "Errors are |predicted − measured| / measured.",
        "",
        "| scenario | strategy | step pred | step meas | err | comm pred | comm meas | err |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in doc["rows"]:
        lines.append(f"| {r['scenario']} | {r['strategy']} | {r['predicted_step_s']:.2f} s | {r['measured_step_s']:.2f} s | "
                     f"{r['step_error']:.0%} | {r['predicted_comm_s']:.2f} s | {r['measured_comm_s']:.2f} s | {r['comm_error']:.0%} |")
    if s.get("step_error"):
        lines += [
            "",
            f"Step time error: median {s['step_error']['median']:.0%}, max {s['step_error']['max']:.0%} "
            f"(target ≤ 10% / ≤ 25%). Communication time error: median {s['comm_error']['median']:.0%}, "
            f"max {s['comm_error']['max']:.0%}; as a share of the step: median {s['comm_error_of_step']['median']:.0%}, "
            f"max {s['comm_error_of_step']['max']:.0%}.",
        ]
    if s.get("corrected_step_error"):
        lines += [
            "",
            f"Online correction (each run's report.json: compute rescaled from its first steps after the "
            f"warm-up, judged on the steps after them): step time error median "
            f"{s['corrected_step_error']['median']:.0%}, max {s['corrected_step_error']['max']:.0%}.",
        ]
    return "\n".join(lines)


def write_benchmarks_section(path: Path, body: str) -> None:
    """Replace what lies between the plan section's markers (nothing else in the file)."""
    text = path.read_text()
    start, end = text.find(MARK_START), text.find(MARK_END)
    if start < 0 or end < start:
        from vpscluster.errors import UserError

        raise UserError(f"{path}: the plan section markers are missing; restore `{MARK_START}` and `{MARK_END}`")
    head = text[: start + len(MARK_START)]
    path.write_text(head + "\n" + body.rstrip() + "\n" + text[end:])
