"""Stopping together: the time budget and a requested stop, agreed at sync points.

Run by the session API (`session/core.py: Session.step`), which the built-in trainer
(`train/trainer.py`) uses too, so a user's loop stops the way `train` does:

- A rank votes at the strategy's sync points only (`Strategy.is_sync_point`: ddp every step,
  diloco the steps an outer update lands), where the ranks wait for each other anyway.
- `StopVote.budget_spent`: with sync points one step apart, once the budget is spent; further
  apart, at the sync point nearest the budget (also when the next one would overshoot it by more
  than this one falls short; the interval is the last one's length in seconds), so a run with
  H = 100 does not overrun by a round.
- `agree`: MAX over a one-integer all-reduce of the votes (0 go on, 1 budget spent,
  STOP_REQUESTED a SIGTERM/SIGINT), so every rank stops after the same step. Its time and bytes
  count as communication (`comm`).
"""

from __future__ import annotations

import signal
from typing import Any

from vpscluster.train.strategies.base import CommStats, ring_allreduce_bytes

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
STOP_REQUESTED = 2
STOPPED_BY = {1: "time_budget", STOP_REQUESTED: "stop_requested"}


class StopVote:
    """One rank's vote on stopping, from the step and seconds of its last sync point."""

    def __init__(self, start_step: int = 0) -> None:
        self.last = (start_step, 0.0)  # (step, seconds into the session) of the last sync point

    def budget_spent(self, step: int, elapsed: float, budget: float) -> bool:
        """Stop at the sync point ending `step`, `elapsed` seconds into the session?"""
        last_step, last_t = self.last
        self.last = (step, elapsed)
        if elapsed >= budget:
            return True
        if step - last_step <= 1:
            return False
        return elapsed + (elapsed - last_t) / 2 >= budget


def agree(code: int, ctx: Any, comm: CommStats) -> int:
    """MAX of every rank's `code` (collective on `ctx.group`; `code` itself without a group)."""
    if ctx.group is None:
        return code
    import torch
    import torch.distributed as dist

    flag = torch.tensor([code], dtype=torch.int32, device=ctx.device)
    with comm.timed(ring_allreduce_bytes(flag.numel() * flag.element_size(), ctx.world_size)):
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=ctx.group)
    return int(flag.item())


def install_handler(handler) -> None:
    """SIGTERM/SIGINT call `handler(signum, frame)` (asking for a stop) instead of killing the
    rank mid-step; outside the main thread (a library caller) the defaults stay."""
    for sig in STOP_SIGNALS:
        try:
            signal.signal(sig, handler)
        except ValueError:
            pass
