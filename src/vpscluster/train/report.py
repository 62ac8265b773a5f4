"""The built-in trainer's run report: the contract keys (DESIGN.md) first, then what the run was.

Every rank's totals are gathered once (collective); rank 0 gets the report (written to the run
dir's report.json and sent in the `end` event), the other ranks None.
"""

from __future__ import annotations

import sys
from typing import Any

from vpscluster.train import checkpoint, diskfull, prediction


def build_report(t: Any, val_loss: float | None, stopped_by: str, start_step: int) -> dict[str, Any] | None:
    """`t`: the Trainer after its final sync, evaluation and checkpoint."""
    import torch

    s = t.session
    tot = s.totals
    # Each rank's final weights, hashed once here: equal on every rank when the strategy keeps
    # replicas identical (DDP every step, DiLoCo after its final sync), and tests compare them.
    mine = {**tot.to_dict(), "collective_busy_seconds": t.strategy.describe().get("collective_busy_seconds"),
            "exporter_cpu_seconds": s.exporter.cpu_seconds(),  # None without exporters
            "model_sha256": checkpoint.state_hash(t.strategy.unwrap().state_dict()),
            "prediction_summary": prediction.rank_summary(t.samples),
            # Log and metrics lines a full disk refused on this rank (train/diskfull.py).
            "log_lines_dropped": diskfull.DROPPED.count,
            # Which environment ran this rank (a provisioned venv shows here).
            "python": sys.executable, "torch": torch.__version__}
    per_rank = s.all_gather_object(mine)
    if not s.is_main:
        return None
    cfg, shares = t.cfg, s.shares
    wall = max(r["wall_seconds"] for r in per_rank)
    tokens = sum(r["tokens"] for r in per_rank)
    n = len(per_rank)
    return {
        "strategy": t.strategy.name,
        "world_size": s.world_size,
        "steps": s.steps,
        "tokens": tokens,
        "wall_seconds": wall,
        "tokens_per_s": tokens / wall if wall > 0 else 0.0,
        "compute_seconds": sum(r["compute_seconds"] for r in per_rank) / n,
        "comm_seconds": sum(r["comm_seconds"] for r in per_rank) / n,
        "compute_utilization": sum(r["compute_seconds"] / r["wall_seconds"] for r in per_rank if r["wall_seconds"] > 0) / n,
        "final_train_loss": sum(s.recent_losses) / len(s.recent_losses) if s.recent_losses else None,
        "final_val_loss": val_loss,
        "bytes_sent": [r["bytes_sent"] for r in per_rank],
        # Beyond the contract: what the run was and how it ended.
        "initial_val_loss": tot.initial_val_loss,
        "resumed_from_step": start_step or None,
        # The ranks that checkpoint was taken with, where it was another number (a node lost or added).
        "resumed_from_world_size": (s.resumed_world_size
                                    if s.resumed_world_size not in (None, s.world_size) else None),
        "stopped_by": stopped_by,
        "preset": cfg.preset,
        "num_params": t.num_params,
        "strategy_details": t.strategy.describe(),
        # DiLoCo's settings the launcher chose from the plan (train/strategies/sync_rule.py) and why.
        "strategy_planned": ({"keys": list(cfg.strategy.launcher.planned), "reason": cfg.strategy.launcher.planned_reason}
                             if cfg.strategy.launcher.planned else None),
        # The sync plan re-made on this session's measured step (train/replan.py), or None.
        "strategy_replanned": t.replanned,
        "sync_failure_rate": t.strategy.describe().get("sync_failure_rate"),  # diloco's outer syncs
        # Log, metrics and event lines dropped because a node's disk was full, all ranks together.
        "log_lines_dropped": sum(r["log_lines_dropped"] for r in per_rank),
        "backend": s.ctx.backend,
        "threads_per_rank": t.threads,
        "per_rank": [
            {"rank": i, **{k: r[k] for k in ("compute_seconds", "comm_seconds", "wall_seconds", "bytes_sent", "collective_busy_seconds",
                                       "exporter_cpu_seconds", "model_sha256", "python", "torch",
                                       "log_lines_dropped")}}
            for i, r in enumerate(per_rank)
        ],
        "model_sha256": mine["model_sha256"],
        "optimizer_sha256": checkpoint.state_hash(t.optimizer.state_dict()),
        "run_dir": str(t.run_dir),
        # The plan's prediction vs this session's measurement, and its online correction.
        "prediction": (prediction.compare(t.prediction, [r["prediction_summary"] for r in per_rank],
                                          comm_every_step=t.strategy.steps_per_sync() == 1)
                       if t.prediction is not None else None),
        **(
            {
                "micro_batches": cfg.strategy.micro_batches,
                "balance": cfg.strategy.balance,
                "shares": list(shares.shares),
                "speeds": [round(v, 4) for v in shares.speeds],
                "rebalances": shares.rebalances,
                "split_gap": round(shares.split_gap(), 4),
                "share_history": shares.history,
            }
            if shares is not None
            else {}
        ),
    }
