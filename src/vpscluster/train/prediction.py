"""The plan's prediction against the run: predicted vs measured, and a correction from the first steps.

The launcher writes the plan's prediction for this very run (strategy, nodes, batch) into the
run directory as `prediction.json` (every node's copy); each rank reads it. Every rank keeps its
own per-step (step seconds, communication seconds) of this session. After `WARMUP` steps (the
first step pays one-off costs, DDP rebuilds its buckets at the second) the next `K` steps form
the *correction window*: once it is full the ranks gather their summaries once (one small
all_gather_object, counted as communication) and rank 0 records a corrected prediction — the
compute term rescaled by the measured compute of the slowest rank, and for DDP (which
communicates every step) the exposed communication replaced by the measured one; DiLoCo's
communication sits in one step of H, so its predicted term stays. At the end the report holds
predicted, corrected and measured figures (step, compute, communication, tokens/s) and each
error |predicted - measured| / measured; the corrected prediction is judged only on the steps
after its window, so its error is what an online correction really achieves.

Measured figures, as the plan defines them: compute = the slowest rank's median compute per
step; step = the mean over ranks of (median compute + mean communication) per step (the median
resists other jobs' spikes, the mean keeps DiLoCo's rare syncs); communication = step - compute
(the exposed communication); tokens/s = tokens per step / step.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

PREDICTION = "prediction.json"
WARMUP = 3  # steps of each session left out of every measured figure
K = 5  # steps of the correction window after the warm-up


def load(run_dir: str | Path) -> dict[str, Any] | None:
    """The run's prediction (written by the launcher), or None when there is none."""
    try:
        doc = json.loads((Path(run_dir) / PREDICTION).read_text())
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) and doc.get("step_seconds") else None


def window_summary(samples: list[tuple[float, float]]) -> dict[str, Any] | None:
    """One rank's (step_s, comm_s) samples -> median compute, mean communication, median step."""
    if not samples:
        return None
    computes = [max(0.0, s - c) for s, c in samples]
    return {"steps": len(samples), "compute_median_s": statistics.median(computes),
            "comm_mean_s": statistics.fmean(c for _, c in samples),
            "step_mean_s": statistics.fmean(s for s, _ in samples)}


def rank_summary(samples: list[tuple[float, float]], warmup: int = WARMUP, k: int = K) -> dict[str, Any]:
    """A rank's summaries: the correction window, the steps after it, and all after the warm-up."""
    after = samples[warmup:]
    return {"window": window_summary(after[:k]), "rest": window_summary(after[k:]), "all": window_summary(after)}


def measured(per_rank: list[dict | None], tokens_per_step: float) -> dict[str, float] | None:
    """Combine the ranks' window summaries into the plan's figures (see the module docstring)."""
    ranks = [r for r in per_rank if r]
    if not ranks:
        return None
    compute = max(r["compute_median_s"] for r in ranks)
    step = statistics.fmean(r["compute_median_s"] + r["comm_mean_s"] for r in ranks)
    step = max(step, compute)
    return {"step_seconds": step, "compute_seconds": compute, "comm_seconds": step - compute,
            "tokens_per_s": tokens_per_step / step if step > 0 else 0.0,
            "steps": min(r["steps"] for r in ranks)}


def corrected(predicted: dict, window: dict | None, comm_every_step: bool) -> dict[str, float] | None:
    """The prediction corrected by the correction window's measurement."""
    if window is None or not predicted.get("compute_seconds"):
        return None
    factor = window["compute_seconds"] / predicted["compute_seconds"]
    compute = predicted["compute_seconds"] * factor
    comm = window["comm_seconds"] if comm_every_step else predicted["comm_seconds"]
    step = compute + comm
    return {"step_seconds": step, "compute_seconds": compute, "comm_seconds": comm,
            "tokens_per_s": predicted["tokens_per_step"] / step if step > 0 else 0.0,
            "compute_factor": factor, "comm_corrected": comm_every_step, "from_steps": window["steps"]}


def errors(pred: dict | None, meas: dict | None) -> dict[str, float | None]:
    """|predicted - measured| / measured for each figure (None where measured is 0 or missing)."""
    keys = ("step_seconds", "compute_seconds", "comm_seconds", "tokens_per_s")
    if not pred or not meas:
        return {k: None for k in keys}
    return {k: (abs(pred[k] - meas[k]) / meas[k] if meas.get(k) else None) for k in keys}


def compare(predicted: dict, summaries: list[dict], comm_every_step: bool) -> dict[str, Any]:
    """The report's `prediction` section from every rank's `rank_summary`."""
    tps = float(predicted["tokens_per_step"])
    window = measured([s["window"] for s in summaries], tps)
    rest = measured([s["rest"] for s in summaries], tps)
    whole = measured([s["all"] for s in summaries], tps)
    pred = {k: predicted[k] for k in ("step_seconds", "compute_seconds", "comm_seconds", "tokens_per_s")}
    corr = corrected(predicted, window, comm_every_step)
    return {
        "label": predicted.get("label"), "compute_source": predicted.get("compute_source"),
        "warmup_steps": WARMUP, "correction_steps": K,
        "predicted": pred, "measured": whole, "error": errors(pred, whole),
        "corrected": corr, "measured_after_correction": rest,
        # The correction judged on steps it never saw; with no such steps, on its own window.
        "corrected_error": errors(corr, rest or window),
    }
