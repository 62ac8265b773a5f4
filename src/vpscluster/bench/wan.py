"""The WAN benchmark: plain torchrun+DDP against vpscluster's strategies on a shaped sandbox.

    run_wan(WanSettings(...), say=print) -> results document    (CLI: `vpscluster bench wan`)

Brings up a sandbox (network namespaces, tc-shaped links, cgroup CPU quotas, sshd per node),
then runs, one after the other and each under the same wall-clock training budget:

- `baseline`: baselines/torchrun_ddp.py next to this module (nothing but torch; shipped with
  the package) through `vpscluster run`;
- `ddp`, `ddp-bf16`, `ddp-powersgd`: `vpscluster train --cluster` with per-step DDP;
- `diloco-fp32`, `diloco-int8`, `diloco-stream` (int8, 4 fragments): DiLoCo with H = --sync-every;
- `auto`: `vpscluster train --strategy auto` with no tuning flag, what a user gets;
- `ideal`: the physical limit as a yardstick: plain synchronous `ddp` on the same nodes and CPU
  quotas with the links' shaping removed (veth speed, a datacenter network), put back after.

Every run gets the same learning-rate schedule (the trainer's defaults: the preset's peak lr
and the warm-up steps of `TrainConfig`, then flat — the cosine horizon is far beyond any budget), the torch-only
baseline included, so that a step means the same thing in every row.

Compute utilisation is compute / training time per rank (evaluation pauses excluded; the
trainer's report divides by wall time instead, kept as `compute_utilization_of_wall`). For each
it reads the bytes every node's interface sent (/sys/class/net/eth0/statistics/tx_bytes
inside the node's namespace, before and after; launch traffic included) and the bytes the
strategy itself counted, and derives from the evaluation points (val loss against tokens and
training seconds, evaluation pauses excluded) the validation loss at the baseline's final token
count (linear interpolation) and the training time each needs to reach the baseline's final
validation loss.

Time to target (`--long`, or any run: `time_to_target`): targets are the validation loss of a
reference row at fractions of its training time (`--targets baseline@0.5,ideal@1`: the
baseline's loss after half its budget, the ideal row's at the end) — levels that need real
learning over a long budget, not the first plateau. For each row: training seconds to each
target (linear between the last evaluation above and the first at or below it), that time
against the baseline's and the ideal row's, tokens/s, utilisation, interface bytes per token,
and the validation loss at equal tokens against the ideal row. Results: `out` (default bench/results/wan-<time>/ under the current
folder): results.json, table.md, every run's files.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from vpscluster.bench import table
from vpscluster.train.strategies import AUTO, COSTS, costs_for

BASELINE = Path(__file__).resolve().parent / "baselines" / "torchrun_ddp.py"
BIG_STEPS = 1_000_000  # runs end by the time budget; the LR schedule is then warm-up + ~flat

# name -> extra `vpscluster train` flags ({H} = --sync-every). `baseline` is the torch-only script.
STRATEGIES: dict[str, list[str]] = {
    "baseline": [],
    "ideal": ["--strategy", "ddp"],  # on unthrottled links (UNTHROTTLED)
    "ddp": ["--strategy", "ddp"],
    "ddp-bf16": ["--strategy", "ddp", "--compress", "bf16"],
    "ddp-powersgd": ["--strategy", "ddp", "--compress", "powersgd"],
    "diloco-fp32": ["--strategy", "diloco", "--sync-every", "{H}", "--wire-dtype", "fp32"],
    "diloco-int8": ["--strategy", "diloco", "--sync-every", "{H}", "--wire-dtype", "int8"],
    "diloco-stream": ["--strategy", "diloco", "--sync-every", "{H}", "--wire-dtype", "int8", "--fragments", "4"],
    "auto": ["--strategy", "auto"],  # no tuning flag: what a user gets
}
UNTHROTTLED = {"ideal"}  # rows run with the sandbox's link shaping removed
QUICK = ["baseline", "ddp", "diloco-int8"]
LONG = ["baseline", "ideal", "ddp", "diloco-int8", "auto"]
DEFAULT_TARGETS = "baseline@0.5,baseline@1,ideal@0.5,ideal@1"
SHORT_BUDGET_S, QUICK_BUDGET_S, LONG_BUDGET_S = 150.0, 60.0, 900.0
SHORT_DDP_EVAL_EVERY, LONG_DDP_EVAL_EVERY = 3, 5


@dataclass
class WanSettings:
    """One benchmark run's scenario and measurement settings (the CLI's flags, same names)."""

    nodes: int = 4
    bandwidth: str = "100mbit"
    cpu: str = "0.45"
    preset: str = "small"
    budget_s: float | None = None  # None: SHORT_BUDGET_S, or LONG_BUDGET_S with --long
    strategies: str | None = None  # None: every strategy, or LONG with --long
    sync_every: int = 50
    ddp_eval_every: int | None = None  # None: SHORT_DDP_EVAL_EVERY, or LONG_DDP_EVAL_EVERY with --long
    diloco_eval_every: int = 0  # 0: H/5 (also for auto, whatever it chooses); runs where an outer update lands
    eval_batches: int = 4
    warmup_steps: int | None = None  # None: the trainer's default (TrainConfig.warmup_steps)
    lr: float | None = None  # None: the trainer's default for the preset (TrainConfig.peak_lr)
    quick: bool = False
    long: bool = False
    targets: str | None = None  # REF@FRACTION,...; None: DEFAULT_TARGETS with --long, no target table otherwise
    name: str = "wan"  # the sandbox's name
    out: str | None = None  # results folder; None: bench/results/wan-<UTC time> here
    rows: tuple[str, ...] = ()  # NAME=TRAIN FLAGS: extra rows, `vpscluster train` with these flags on the shaped links

    def resolved(self) -> "WanSettings":
        """Every None filled in. --quick: only the QUICK strategies, a 60 s budget at most and
        H = 25; --long: the LONG strategies, 900 s each, evaluations every 5 DDP steps."""
        import dataclasses

        from vpscluster.errors import UserError
        from vpscluster.train.config import TrainConfig

        if self.quick and self.long:
            raise UserError("--quick and --long exclude each other; pick one")
        train = TrainConfig()
        r = dataclasses.replace(
            self,
            budget_s=self.budget_s if self.budget_s is not None else (LONG_BUDGET_S if self.long else SHORT_BUDGET_S),
            strategies=self.strategies or ",".join(LONG if self.long else STRATEGIES),
            ddp_eval_every=self.ddp_eval_every or (LONG_DDP_EVAL_EVERY if self.long else SHORT_DDP_EVAL_EVERY),
            warmup_steps=train.warmup_steps if self.warmup_steps is None else self.warmup_steps,
            lr=TrainConfig(preset=self.preset).peak_lr() if self.lr is None else self.lr,
            targets=self.targets or (DEFAULT_TARGETS if self.long else ""),
        )
        if not self.quick:
            return r
        return dataclasses.replace(r, strategies=",".join(QUICK), budget_s=min(r.budget_s, QUICK_BUDGET_S), sync_every=25)


def custom_rows(specs) -> dict[str, list[str]]:
    """`--row NAME='TRAIN FLAGS'` (repeatable) -> {name: flags}: extra rows that run `vpscluster
    train` with these flags on the shaped links, beside the built-in rows (an experiment, e.g. a
    flag's effect over a long budget, measured against the same baseline and ideal rows). The
    benchmark's own flags (cluster, budget, run folder, evaluation) come after, so they win."""
    import re

    from vpscluster.errors import UserError

    rows: dict[str, list[str]] = {}
    for spec in specs or ():
        name, sep, flags = spec.partition("=")
        name = name.strip()
        try:
            argv = shlex.split(flags)
        except ValueError:
            argv = []
        if not sep or not argv or not re.fullmatch(r"[a-z0-9][a-z0-9-]*", name) or name in STRATEGIES or name in rows:
            raise UserError(f"--row {spec!r}: write NAME='TRAIN FLAGS' with a new lower-case name (not a built-in row) "
                            "and at least one flag, e.g. --row 'auto-lr1=--strategy auto --inner-lr-scale 1'")
        rows[name] = argv
    return rows


def run_wan(settings: WanSettings, say: Callable[[str], None] = lambda line: None) -> dict[str, Any]:
    """Run every strategy on one sandbox and compare; the results document (also results.json).

    A failed strategy is recorded in its row (`failed`: why) and the others still run; a failed
    baseline is a `UserError` (every figure is relative to it).
    """
    from vpscluster.cluster import sandbox
    from vpscluster.errors import RemoteError, UserError
    from vpscluster.train.presets import get_preset

    args = settings.resolved()
    extra_rows = custom_rows(args.rows)
    row_flags = {**STRATEGIES, **extra_rows}  # name -> `vpscluster train` flags
    names = [s.strip() for s in args.strategies.split(",") if s.strip()]
    unknown = [s for s in names if s not in STRATEGIES]
    names += [name for name in extra_rows if name not in names]
    if unknown or not names:
        raise UserError(f"--strategies: unknown {', '.join(unknown) or '(none given)'}; choose from {', '.join(STRATEGIES)}")
    if "baseline" not in names:
        raise UserError("--strategies must include baseline: every figure is relative to it")
    if args.budget_s <= 0 or args.sync_every < 1:
        raise UserError("--budget-s must be positive and --sync-every at least 1")
    if args.lr <= 0 or args.warmup_steps < 0:
        raise UserError("--lr must be positive and --warmup-steps not negative")
    targets = parse_targets(args.targets)
    shape = get_preset(args.preset)
    out = Path(args.out or Path("bench") / "results" / time.strftime("wan-%Y%m%d-%H%M%S", time.gmtime())).resolve()
    out.mkdir(parents=True, exist_ok=True)
    corpus = out / "corpus.txt"  # the bundled corpus, the same bytes vpscluster train reads
    from vpscluster.train.data import read_corpus

    corpus.write_bytes(read_corpus(None))

    say(f"sandbox {args.name}: {args.nodes} nodes x {args.bandwidth}, CPU {args.cpu} each")
    info = sandbox.up(args.name, nodes=args.nodes, bandwidth=args.bandwidth, cpu=args.cpu, progress=lambda m: say(f"  {m}"))
    runs: dict[str, dict[str, Any]] = {}
    failed: dict[str, str] = {}
    try:
        for name in names:
            before = _tx_bytes(info)
            t0 = time.perf_counter()
            say(f"{name}: launching and training ({args.budget_s:g} s budget; log {out / name}.log)")
            try:
                if name == "baseline":
                    result = _run_baseline(args, info, shape, corpus, out)
                elif name in UNTHROTTLED:
                    with unthrottled(info, say):
                        result = _run_train(args, info, name, row_flags[name], out)
                else:
                    result = _run_train(args, info, name, row_flags[name], out)
            except (RemoteError, subprocess.TimeoutExpired, OSError, ValueError, KeyError) as e:
                # One failed strategy must not cost the others' results: record it and go on.
                failed[name] = str(e).splitlines()[0][:300]
                say(f"  {name} failed: {failed[name]}")
                if name == "baseline":
                    raise UserError(f"the baseline failed, so nothing can be compared: {failed[name]}") from None
                continue
            result["elapsed_s"] = time.perf_counter() - t0
            result["interface_tx_bytes"] = [a - b for a, b in zip(_tx_bytes(info), before)]
            runs[name] = result
            (out / f"{name}.json").write_text(json.dumps(result, indent=1))
            say(f"  {name}: {result['steps']} steps, {result['tokens']} tokens, val {result['final_val_loss']:.4f}")
    finally:
        try:
            sandbox.down(args.name)
        except OSError as e:  # someone removed it under us: say so, keep the results
            say(f"warning: sandbox {args.name} teardown: {e}")
    rows = compare(runs) + [{"strategy": name, "failed": why} for name, why in failed.items()]
    target_rows, target_levels = time_to_target(runs, targets)
    target_rows += [{"strategy": name, "failed": why} for name, why in failed.items()]
    doc = {
        "command": "vpscluster bench wan " + " ".join(_argv_of(args)),
        "scenario": {"nodes": args.nodes, "bandwidth": args.bandwidth, "cpu": args.cpu, "preset": args.preset,
                     "num_params": shape.num_params(), "budget_s": args.budget_s, "sync_every": args.sync_every,
                     "warmup_steps": args.warmup_steps, "lr": args.lr, "eval_batches": args.eval_batches,
                     "ddp_eval_every": args.ddp_eval_every, "long": args.long, "rows": dict(extra_rows)},
        "machine": _machine(),
        "rows": rows,
        "targets": target_levels,
        "time_to_target": target_rows,
        "results_dir": str(out),
    }
    (out / "results.json").write_text(json.dumps(doc, indent=1))
    text = markdown_table(rows) + "\n"
    if targets:
        text += "\n" + target_legend(target_levels) + "\n\n" + target_markdown(target_levels, target_rows) + "\n"
    (out / "table.md").write_text(text)
    return doc


# -- running one strategy ---------------------------------------------------------------------


def _cli(argv: list[str], log: Path, timeout_s: float) -> subprocess.CompletedProcess:
    with log.open("w") as err:
        proc = subprocess.run([sys.executable, "-m", "vpscluster", *argv], stdout=subprocess.PIPE, stderr=err,
                              text=True, timeout=timeout_s)
    if proc.returncode != 0:
        from vpscluster.errors import RemoteError

        tail = log.read_text().strip().splitlines()[-1:] or ["(no output)"]
        raise RemoteError(f"`vpscluster {' '.join(argv[:2])}` failed ({tail[0]}); full log: {log}")
    return proc


def _run_train(args, info, name: str, flags: list[str], out: Path) -> dict[str, Any]:
    H = args.sync_every
    extra = [a.replace("{H}", str(H)) for a in flags]
    # A strategy that meets in rounds (diloco); auto: most likely diloco on slow links.
    rounds = any(a == AUTO or (a in COSTS and costs_for(a).takes("sync_every")) for a in extra)
    # in rounds (diloco): due every H/5 steps, run where the next outer update lands (auto's H may be smaller)
    eval_every = (args.diloco_eval_every or max(1, H // 5)) if rounds else args.ddp_eval_every
    run_dir = out / name
    config = out / f"{name}.config.yaml"
    config.write_text(f"eval_batches: {args.eval_batches}\nlr_decay_steps: {BIG_STEPS}\nwarmup_steps: {args.warmup_steps}\n"
                      f"lr: {args.lr!r}\n")
    argv = ["train", "--cluster", info.cluster_file, "--preset", args.preset, *extra, "--time-budget", str(args.budget_s),
            "--max-steps", str(BIG_STEPS), "--eval-every", str(eval_every), "--checkpoint-every", str(H * BIG_STEPS),
            "--config", str(config), "--run-dir", str(run_dir), "--json",
            "--max-restarts", "0"]  # a row measures one launch: a failure ends it (recovery is on by default)
    report = json.loads(_cli(argv, out / f"{name}.log", args.budget_s + 900).stdout)
    evals = evals_from_metrics(run_dir / "metrics.jsonl")
    # Utilisation while training: compute / (compute + communication) per rank, averaged; the
    # report's own figure divides by wall time, evaluation pauses included (kept as well).
    ranks = report["per_rank"]
    util = sum(r["compute_seconds"] / max(1e-9, r["compute_seconds"] + r["comm_seconds"]) for r in ranks) / len(ranks)
    compute_per_step = sum(r["compute_seconds"] for r in ranks) / len(ranks) / max(1, report["steps"])
    return {
        "compute_s_per_step": compute_per_step,
        "name": name, "steps": report["steps"], "tokens": report["tokens"], "wall_seconds": report["wall_seconds"],
        "tokens_per_s": report["tokens_per_s"], "compute_utilization": util,
        "compute_utilization_of_wall": report["compute_utilization"],
        "final_val_loss": report["final_val_loss"], "strategy_bytes_sent": report["bytes_sent"],
        "strategy": report.get("strategy_details"), "ran_as": report.get("strategy"), "evals": evals,
        "replanned": report.get("strategy_replanned"),  # the sync plan re-made on the measured step, if it was
        "links": "unthrottled" if name in UNTHROTTLED else "shaped",
    }


def _run_baseline(args, info, shape, corpus: Path, out: Path) -> dict[str, Any]:
    result_file = out / "baseline" / "result.json"
    result_file.parent.mkdir(parents=True, exist_ok=True)
    script = ["python", BASELINE.name, "--data", str(corpus), "--out", str(result_file),
              "--d-model", str(shape.d_model), "--n-layer", str(shape.n_layer), "--n-head", str(shape.n_head),
              "--seq-len", str(shape.seq_len), "--batch-size", str(shape.batch_size), "--max-steps", str(BIG_STEPS),
              "--lr-decay-steps", str(BIG_STEPS), "--time-budget", str(args.budget_s),
              "--eval-every", str(args.ddp_eval_every), "--eval-batches", str(args.eval_batches),
              "--warmup-steps", str(args.warmup_steps), "--lr", repr(args.lr)]
    argv = ["run", "--cluster", info.cluster_file, "--sync", str(BASELINE.parent), "--run-dir", str(out / "baseline" / "launch"),
            "--", *script]
    _cli(argv, out / "baseline.log", args.budget_s + 900)
    r = json.loads(result_file.read_text())
    return {
        "compute_s_per_step": (r["compute_seconds_estimate"] / r["steps"]) if r["compute_seconds_estimate"] else None,
        "name": "baseline", "steps": r["steps"], "tokens": r["tokens"], "wall_seconds": r["wall_seconds"],
        "tokens_per_s": r["tokens_per_s"],
        # DDP overlaps its all-reduce with backward, so compute is estimated from timed no_sync()
        # steps (see the script) and divided by the training time, evaluation pauses excluded.
        "compute_utilization": (r["compute_seconds_estimate"] / r["train_seconds"]) if r["compute_seconds_estimate"] else None,
        "compute_utilization_of_wall": r["compute_utilization"],
        "final_val_loss": r["final_val_loss"], "strategy_bytes_sent": None,  # plain DDP counts nothing
        "evals": [{"tokens": e["tokens"], "seconds": e["train_seconds"], "val_loss": e["val_loss"]} for e in r["evals"]],
    }


def evals_from_metrics(path: Path) -> list[dict[str, float]]:
    """(tokens, training seconds, val loss) at every evaluation of a vpscluster run's metrics.jsonl."""
    tokens = seconds = 0.0
    evals = []
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        if "loss" in rec:
            tokens += rec["tokens"]
            seconds += rec["step_seconds"]
        if "val_loss" in rec:
            evals.append({"tokens": tokens, "seconds": seconds, "val_loss": rec["val_loss"]})
    return evals


@contextlib.contextmanager
def unthrottled(info, say: Callable[[str], None]):
    """The sandbox's links without shaping for the block (the `ideal` row); shaping restored after."""
    from vpscluster.cluster.sandbox import links, shaping

    say("  links unthrottled (no tc shaping) for this row")
    try:
        for node in info.nodes:
            shaping.unshape_node(node.namespace, node.veth)
        yield
    finally:
        for node in info.nodes:
            links.shape(info, node)  # its port and its per-pair rates
        say(f"  links shaped again ({', '.join(f'{n.bandwidth_mbit:g}' for n in info.nodes)} Mbit/s)")


def _tx_bytes(info) -> list[int]:
    counts = []
    for node in info.nodes:
        proc = subprocess.run(["ip", "netns", "exec", node.namespace, "cat", "/sys/class/net/eth0/statistics/tx_bytes"],
                              capture_output=True, text=True, timeout=10)
        if proc.returncode != 0:
            from vpscluster.errors import RemoteError

            from vpscluster.cluster.executor import last_words

            raise RemoteError(f"cannot read node {node.name}'s tx_bytes: {last_words(proc.stderr, None, proc.returncode)}")
        counts.append(int(proc.stdout))
    return counts


# -- the comparison -----------------------------------------------------------------------------


def loss_at_tokens(evals: list[dict[str, float]], tokens: float) -> float | None:
    """Val loss at `tokens`, linear between evaluation points; None beyond the last one."""
    for a, b in zip(evals, evals[1:]):
        if a["tokens"] <= tokens <= b["tokens"]:
            if b["tokens"] == a["tokens"]:
                return b["val_loss"]
            w = (tokens - a["tokens"]) / (b["tokens"] - a["tokens"])
            return a["val_loss"] + w * (b["val_loss"] - a["val_loss"])
    return None


def seconds_to_loss(evals: list[dict[str, float]], target: float) -> float | None:
    """Training seconds at the first evaluation at or below `target`; None if never."""
    return next((e["seconds"] for e in evals if e["val_loss"] <= target), None)


def compare(runs: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    base = runs["baseline"]
    target_tokens, target_loss = base["tokens"], base["final_val_loss"]
    base_time = seconds_to_loss(base["evals"], target_loss)
    base_bpt = sum(base["interface_tx_bytes"]) / max(1, base["tokens"])
    rows = []
    for name, r in runs.items():
        n = len(r["interface_tx_bytes"])
        at_equal = loss_at_tokens(r["evals"], target_tokens)
        to_target = seconds_to_loss(r["evals"], target_loss)
        bpt = sum(r["interface_tx_bytes"]) / max(1, r["tokens"])
        rows.append({
            "strategy": name, "steps": r["steps"], "tokens": r["tokens"], "tokens_per_s": r["tokens_per_s"],
            "compute_utilization": r["compute_utilization"], "compute_s_per_step": r.get("compute_s_per_step"),
            "iface_mb_per_node": sum(r["interface_tx_bytes"]) / n / 1e6,
            "counted_mb_per_node": (sum(r["strategy_bytes_sent"]) / len(r["strategy_bytes_sent"]) / 1e6) if r["strategy_bytes_sent"] else None,
            "iface_bytes_per_token": bpt, "bytes_per_token_reduction": base_bpt / bpt if bpt else None,
            "final_val_loss": r["final_val_loss"], "val_loss_at_baseline_tokens": at_equal,
            "val_loss_vs_baseline_pct": 100 * (at_equal / target_loss - 1) if at_equal is not None else None,
            "seconds_to_baseline_loss": to_target,
            "speedup_to_baseline_loss": base_time / to_target if to_target and base_time else None,
        })
    return rows


COLUMNS = [  # (key, header, format)
    ("strategy", "strategy", "{}"), ("steps", "steps", "{}"), ("tokens_per_s", "tok/s", "{:.0f}"),
    ("compute_utilization", "util", "{:.0%}"), ("iface_mb_per_node", "MB/node iface", "{:.1f}"),
    ("counted_mb_per_node", "MB/node counted", "{:.1f}"), ("bytes_per_token_reduction", "B/tok ÷", "{:.1f}x"),
    ("final_val_loss", "val end", "{:.3f}"), ("val_loss_at_baseline_tokens", "val @base tok", "{:.3f}"),
    ("val_loss_vs_baseline_pct", "Δ val", "{:+.1f}%"), ("seconds_to_baseline_loss", "s to base val", "{:.0f}"),
    ("speedup_to_baseline_loss", "speed-up", "{:.2f}x"),
]


# -- time to target (the long mode) --------------------------------------------------------------


def parse_targets(text: str) -> list[tuple[str, float]]:
    """`baseline@0.5,ideal@1` -> [("baseline", 0.5), ("ideal", 1.0)]; a one-line UserError if malformed."""
    from vpscluster.errors import UserError

    out = []
    for item in (t.strip() for t in (text or "").split(",")):
        if not item:
            continue
        ref, _, frac = item.partition("@")
        try:
            fraction = float(frac)
        except ValueError:
            fraction = -1.0
        if ref not in STRATEGIES or not 0 < fraction <= 1:
            raise UserError(f"--targets: {item!r} is not STRATEGY@FRACTION (a strategy of the run, a fraction of its "
                            f"training time in (0, 1]); write e.g. baseline@0.5,ideal@1")
        out.append((ref, fraction))
    return out


def loss_at_seconds(evals: list[dict[str, float]], seconds: float) -> float | None:
    """Val loss after `seconds` of training, linear between evaluation points; None beyond the last."""
    for a, b in zip(evals, evals[1:]):
        if a["seconds"] <= seconds <= b["seconds"]:
            if b["seconds"] == a["seconds"]:
                return b["val_loss"]
            w = (seconds - a["seconds"]) / (b["seconds"] - a["seconds"])
            return a["val_loss"] + w * (b["val_loss"] - a["val_loss"])
    return None


def seconds_to_target(evals: list[dict[str, float]], target: float) -> float | None:
    """Training seconds at which the val loss first reaches `target`: linear between the last
    evaluation above it and the first at or below it (the first evaluation's time if that one
    already is); None if no evaluation reaches it."""
    for i, e in enumerate(evals):
        if e["val_loss"] <= target:
            if i == 0:
                return e["seconds"]
            a = evals[i - 1]
            w = (a["val_loss"] - target) / (a["val_loss"] - e["val_loss"])
            return a["seconds"] + w * (e["seconds"] - a["seconds"])
    return None


def _ratio(num: float | None, den: float | None) -> float | None:
    return num / den if num is not None and den else None


def time_to_target(runs: dict[str, dict[str, Any]], targets: list[tuple[str, float]]) -> tuple[list[dict], list[dict]]:
    """(rows, levels): every run's time to each target level, and the levels themselves.

    A level is `ref`'s val loss after `fraction` of its training time (None when `ref` did not
    run). Per row and level i: `t{i}_s` (training seconds, None if never reached),
    `t{i}_vs_baseline` (the baseline's time / this row's: the speed-up) and `t{i}_vs_ideal`
    (this row's time / the ideal row's: 1.0 is the physical limit). Also: interface bytes per
    token, their reduction against the baseline, and the val loss at equal tokens against the
    ideal row (both at the smaller of the two rows' final token counts).
    """
    levels = []
    for ref, fraction in targets:
        level = {"name": f"{ref}@{fraction:g}", "ref": ref, "fraction": fraction, "ref_seconds": None, "val_loss": None}
        if ref in runs and runs[ref]["evals"]:
            level["ref_seconds"] = fraction * runs[ref]["evals"][-1]["seconds"]
            level["val_loss"] = loss_at_seconds(runs[ref]["evals"], level["ref_seconds"])
            if level["val_loss"] is None:  # a single evaluation: its loss
                level["val_loss"] = runs[ref]["evals"][-1]["val_loss"]
        levels.append(level)

    def bpt(r):
        return sum(r["interface_tx_bytes"]) / r["tokens"] if r.get("interface_tx_bytes") and r["tokens"] else None

    times = {name: [seconds_to_target(r["evals"], lv["val_loss"]) if lv["val_loss"] is not None else None for lv in levels]
             for name, r in runs.items()}
    base_bpt = bpt(runs["baseline"]) if "baseline" in runs else None
    ideal = runs.get("ideal")
    rows = []
    for name, r in runs.items():
        row = {"strategy": name, "ran_as": r.get("ran_as") or ("torch DDP" if name == "baseline" else None),
               "links": r.get("links", "shaped"), "steps": r["steps"], "tokens": r["tokens"],
               "tokens_per_s": r["tokens_per_s"], "compute_utilization": r["compute_utilization"],
               "iface_bytes_per_token": bpt(r), "final_val_loss": r["final_val_loss"]}
        row["bytes_per_token_reduction"] = _ratio(base_bpt, row["iface_bytes_per_token"])
        row["equal_tokens"] = row["val_loss_at_equal_tokens"] = row["ideal_val_loss_at_equal_tokens"] = None
        row["val_loss_vs_ideal_pct"] = None
        if ideal and ideal["evals"] and r["evals"]:
            t = min(r["evals"][-1]["tokens"], ideal["evals"][-1]["tokens"])
            mine, best = loss_at_tokens(r["evals"], t), loss_at_tokens(ideal["evals"], t)
            row.update(equal_tokens=t, val_loss_at_equal_tokens=mine, ideal_val_loss_at_equal_tokens=best)
            if mine is not None and best:
                row["val_loss_vs_ideal_pct"] = 100 * (mine / best - 1)
        for i, t in enumerate(times[name]):
            row[f"t{i}_s"] = t
            row[f"t{i}_vs_baseline"] = _ratio(times["baseline"][i], t) if "baseline" in times and t else None
            row[f"t{i}_vs_ideal"] = _ratio(t, times["ideal"][i]) if "ideal" in times else None
        rows.append(row)
    return rows, levels


FIGURE_COLUMNS = [  # the long mode's per-row figures; the times to target are a table of their own
    ("strategy", "strategy", "{}"), ("ran_as", "ran as", "{}"), ("steps", "steps", "{}"), ("tokens_per_s", "tok/s", "{:.0f}"),
    ("compute_utilization", "util", "{:.0%}"), ("iface_bytes_per_token", "B/tok", "{:.0f}"),
    ("bytes_per_token_reduction", "B/tok ÷", "{:.1f}x"), ("final_val_loss", "val end", "{:.3f}"),
    ("val_loss_at_equal_tokens", "val @eq tok", "{:.3f}"), ("val_loss_vs_ideal_pct", "Δ vs ideal", "{:+.1f}%"),
]


def target_columns(levels: list[dict]) -> table.Columns:
    """strategy, then one column per target: key `t{i}`, rendered by `cell` as "s (÷ base / × ideal)"."""
    cols = [("strategy", "strategy", "{}")]
    for i, lv in enumerate(levels):
        loss = "—" if lv["val_loss"] is None else f"{lv['val_loss']:.3f}"
        cols.append((f"t{i}", f"→ {lv['name']} ({loss})", "{:.0f}"))
    return cols


def target_legend(levels: list[dict]) -> str:
    parts = [f"{lv['name']} = {lv['val_loss']:.3f} ({lv['ref']}'s val loss after {lv['ref_seconds']:.0f} s of training)"
             if lv["val_loss"] is not None else f"{lv['name']} = — ({lv['ref']} did not run)" for lv in levels]
    return ("Targets: " + "; ".join(parts) + ". A cell: training seconds to reach the target (linear between "
            "evaluations), then (the baseline's time / this row's, i.e. the speed-up; this row's time / the ideal "
            "row's, 1.00x = the physical limit); — : not reached or not run. *B/tok*: interface bytes per token; "
            "*val @eq tok*: val loss at the smaller of this row's and ideal's final token counts, *Δ vs ideal* "
            "against ideal's there.")


def target_markdown(levels: list[dict], rows: list[dict]) -> str:
    """Two tables: the per-row figures (FIGURE_COLUMNS) and the times to each target."""
    return table.markdown(rows, FIGURE_COLUMNS, cell) + "\n\n" + table.markdown(rows, target_columns(levels), cell)


def cell(row, key, fmt) -> str:
    if key[:1] == "t" and key[1:].isdigit():  # a time to target with its two ratios
        if row.get(f"{key}_s") is None:
            return "—"
        ratios = [table.cell(row, f"{key}_{r}", "{:.2f}x") for r in ("vs_baseline", "vs_ideal")]
        return f"{row[key + '_s']:.0f} s ({ratios[0]} / {ratios[1]})"
    return table.cell(row, key, fmt, name_key="strategy")


def markdown_table(rows: list[dict[str, Any]]) -> str:
    return table.markdown(rows, COLUMNS, cell)


def _argv_of(args) -> list[str]:
    out = ["--long"] if args.long else []
    for flag in ("nodes", "bandwidth", "cpu", "preset", "budget_s", "strategies", "sync_every", "warmup_steps", "lr",
                 "ddp_eval_every", "targets"):
        if getattr(args, flag) not in (None, ""):
            out += ["--" + flag.replace("_", "-"), str(getattr(args, flag))]
    for spec in args.rows or ():
        out += ["--row", shlex.quote(spec)]
    return out


def _machine() -> dict[str, Any]:
    import platform

    from vpscluster.nodeside.facts import cpu_model

    return {"cpu": cpu_model() or platform.processor(), "cpus": os.cpu_count(), "kernel": platform.release(), "python": platform.python_version()}
