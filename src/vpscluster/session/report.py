"""The session's report: the run report's contract keys (DESIGN.md), counted in samples.

Every rank's totals are gathered once (collective); every rank gets the same document, rank 0
writes it to the run dir's report.json. `model_sha256` per rank is the hash of its final weights
(`train.checkpoint.state_hash`): after `close` they are equal on every rank, ddp and diloco alike.
"""

from __future__ import annotations

import sys
from typing import Any

from vpscluster.train import checkpoint


def build_report(s) -> dict[str, Any]:
    import torch

    t = s.totals
    describe = s.strategy.describe()
    mine = {**t.to_dict(), "collective_busy_seconds": describe.get("collective_busy_seconds"),
            "model_sha256": checkpoint.state_hash(s.unwrap().state_dict()),
            "python": sys.executable, "torch": torch.__version__}
    per_rank = s.all_gather_object(mine)
    n = len(per_rank)
    wall = max(r["wall_seconds"] for r in per_rank)
    samples = sum(r["tokens"] for r in per_rank)  # Totals counts the loop's units: samples here
    losses = list(s.recent_losses)
    return {
        "strategy": s.strategy.name,
        "world_size": s.world_size,
        "steps": s.steps,
        "samples": samples,
        "tokens": samples,  # the contract's name for the units trained on
        "wall_seconds": wall,
        "samples_per_s": samples / wall if wall > 0 else 0.0,
        "tokens_per_s": samples / wall if wall > 0 else 0.0,
        "compute_seconds": sum(r["compute_seconds"] for r in per_rank) / n,
        "comm_seconds": sum(r["comm_seconds"] for r in per_rank) / n,
        "compute_utilization": sum(r["compute_seconds"] / r["wall_seconds"] for r in per_rank
                                   if r["wall_seconds"] > 0) / n,
        "final_train_loss": sum(losses) / len(losses) if losses else None,
        "final_val_loss": None,  # the script evaluates; the session does not know its data's split
        "bytes_sent": [r["bytes_sent"] for r in per_rank],
        "stopped_by": s.stopped_by or "end_of_loop",
        "resumed_from_step": s._start_step or None,
        "strategy_details": describe,
        "sync_failure_rate": describe.get("sync_failure_rate"),
        "backend": s.ctx.backend,
        "model_sha256": mine["model_sha256"],
        "per_rank": [{"rank": i, **{k: r[k] for k in ("compute_seconds", "comm_seconds", "wall_seconds", "bytes_sent",
                                                      "collective_busy_seconds", "model_sha256", "python", "torch")}}
                     for i, r in enumerate(per_rank)],
        "run_dir": str(s.run_dir) if s.run_dir is not None else None,
        **({"strategy_choice": (s.auto.made or {"settings": {"name": s.strategy.name}, "at_step": None,
                                                 "reason": f"{s.strategy.name}: the run ended before the "
                                                           f"measured steps the choice needs"})}
           if s.auto is not None else {}),
        **({"micro_batches": s.shares.total, "shares": s._shares(), "balance": bool(s.cfg.strategy.balance),
            "speeds": [round(v, 6) for v in s.shares.speeds], "rebalances": s.shares.rebalances,
            **({"batch_sizes": list(s._sizes[2])} if s.weighted and s._sizes is not None else {})}
           if s.shares is not None else {}),
    }
