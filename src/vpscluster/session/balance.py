"""Uneven shares re-split from measured speeds (`strategy.balance`), for any loop on the session.

After each loop step every rank adds its compute seconds and micro-batches to a window; a
session's first step pays one-off costs and is left out. A first look comes early in every
session (its third step), then every `look_every` steps (DiLoCo: whole rounds,
`train.shares.look_every`): all ranks gather what they measured and feed the same figures to the
same controller (`train.shares.ShareController`), so the new shares are identical everywhere.
"""

from __future__ import annotations

from typing import Any


def after_step(s: Any, compute_s: float) -> None:
    """`s`: the Session, right after it recorded a loop step that took `compute_s` of compute."""
    session_step = s.steps - s.start_step
    if session_step == 1:  # a session's first step pays one-off costs: not a speed
        s.window = [0.0, 0]
    else:
        s.window[0] += max(0.0, compute_s)
        s.window[1] += s.shares.shares[s.rank]  # the micro-batches this rank ran (shares change only below)
    if s.cfg.strategy.balance and session_step > 1 and (session_step == 3 or s.steps % s.look_every == 0):
        look(s)


def look(s: Any) -> None:
    with s.strategy.comm.timed(0):
        measured = s.all_gather_object((float(s.window[0]), int(s.window[1])))
    s.book_off_comm()
    s.window = [0.0, 0]
    shares = s.shares
    before = list(shares.shares)
    if shares.observe(measured, s.steps):
        s.events.emit(
            "rebalance", step=s.steps, shares_before=before, shares=list(shares.shares),
            speeds=[round(v, 4) for v in shares.speeds], rebalances=shares.rebalances,
            split_gap=round(shares.split_gap(), 4), batch_size=s.batch_size,
            sync_every=s.strategy.config.sync_every if s.strategy.micro_batches_are_steps else None,
        )
