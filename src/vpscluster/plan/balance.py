"""Balancing by default: the micro-batch split a run on uneven nodes starts with (pure Python).

When the ranks' speeds (the probe's FLOP/s per rank, `train/shares.py: node_speeds_from_probe`)
differ by more than `SPREAD`, `train` runs shares of the global batch instead of the even split,
where every rank waits for the slowest (0.36 of the even spread's tokens/s on 0.45/0.45/0.45/0.15
cores, issue #36). `choose_split` picks the shares' granularity:

- ddp (a rank accumulates its micro-batches into one optimizer step): the global batch of
  world x batch_size sequences stays; it is cut into micro-batches of batch_size / k sequences,
  k the smallest divisor of batch_size whose split comes within `GAP_HINT` of an exact one.
  The gradient is the even split's (`train/trainer.py: _shared_step`), so a step learns the same.
  A ddp session (`run`; batch_size None, the script names it later) splits the step's world x B
  samples into k x world parts, k up to SESSION_PARTS_K: rank i reads one batch of its parts'
  samples, its gradient weighted by the batch (`session/shard.py`).
- diloco (each micro-batch is an inner step of its own): the inner step's batch_size stays, so
  the split is made finer with k x world micro-batches per step and a round of H / k steps - the
  same H inner steps (on average) per rank per round, the same tokens per round. A step then
  carries k even steps' tokens, so the run's step counts are divided by k (`scaled_steps`).
  k is the smallest divisor of H within GAP_HINT that leaves a round `min_round_steps` steps: one
  per streaming fragment, and one more than the overlapped steps (an outer sync overlaps at most
  H - 1 steps: at H / k = 1 it would block. Measured: k = 10 at H = 10, a blocking sync every
  step, ran at 87% of the even spread, 2026-12-07).

Where the plan chose H (not the user), `choose_split_near` may move H by up to a quarter to a
value whose divisors split the speeds better. Where no k reaches GAP_HINT, the one with the smallest gap (none when only the even split of one
micro-batch per rank is possible). The runtime controller
(`ShareController`, `balance` on) then corrects a probe that was wrong from the first steps'
measured times.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from vpscluster.train.shares import GAP_HINT, split, split_gap

SPREAD = 1.15  # ranks whose speeds differ by more than this factor are balanced by default


@dataclass(frozen=True)
class BalancedSplit:
    """The shares a balanced run starts with and the settings that give them."""

    micro_batches: int  # per step, all ranks together
    batch_size: int | None  # sequences per micro-batch (None: a ddp session's, the script's batch in parts)
    steps_per_step: int  # k: a step carries k even steps' tokens (ddp: 1)
    sync_every: int | None  # diloco: steps per round (H / k); None for ddp
    shares: tuple[int, ...]  # micro-batches per rank, in the order of the speeds given
    gap: float  # how much longer than an exact split (`shares.split_gap`)


def needs_balance(speeds: Sequence[float], spread: float = SPREAD) -> bool:
    """True when the fastest rank is more than `spread` times as fast as the slowest."""
    return len(speeds) > 1 and max(speeds) > spread * min(speeds)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


# A ddp session's batch is the script's (`shard(batch_size=B)`), unknown to the launcher: its split
# is in parts of the step's world x B samples, k x world parts, k at most this.
SESSION_PARTS_K = 16


def choose_split(speeds: Sequence[float], batch_size: int | None, micro_batches_are_steps: bool,
                 sync_every: int | None = None, min_round_steps: int = 1, min_share: int = 1,
                 max_spread: float = 8.0, gap: float = GAP_HINT) -> BalancedSplit | None:
    """The split for ranks of these relative `speeds` (one per rank), or None when they are
    within SPREAD of each other (the even split is as good). See the module docstring."""
    if not needs_balance(speeds):
        return None
    world = len(speeds)
    if micro_batches_are_steps:
        if not sync_every:
            raise ValueError("a split whose micro-batches are steps needs sync_every (H)")
        ks = [k for k in _divisors(sync_every) if sync_every // k >= min_round_steps]
    elif batch_size is None:  # a ddp session: parts of the step's samples, any k (session/shard.py)
        ks = list(range(1, SESSION_PARTS_K + 1))
        gap = 1e-9  # finer parts cost it nothing (one batch a rank still): the closest split wins
    else:
        ks = _divisors(batch_size)
    even_gap = split_gap([1] * world, speeds, max_spread)  # one micro-batch per rank (k = 1)
    best = None
    for k in ks:
        total = k * world
        if k == 1 or total < min_share * world:
            continue
        shares = split(speeds, total, min_share, max_spread)
        g = split_gap(shares, speeds, max_spread)
        candidate = BalancedSplit(
            micro_batches=total,
            batch_size=batch_size if micro_batches_are_steps or batch_size is None else batch_size // k,
            steps_per_step=k if micro_batches_are_steps else 1,
            sync_every=sync_every // k if micro_batches_are_steps else None,
            shares=tuple(shares), gap=g)
        if g <= gap:
            return candidate
        if best is None or g < best.gap - 1e-12:
            best = candidate
    # Too coarse to beat the even split (e.g. diloco at H = 1, ddp at one sequence per rank).
    return best if best is not None and best.gap < even_gap else None


# The plan's H moves (`choose_split_near`) when a neighbour's split comes this much closer to exact:
# a split within GAP_HINT (10%) still costs the fast ranks up to 10% of their time, which the
# moved H can win back (issue 36's re-measure: H = 10 split 7/6/6/1 by the probe's figures, 15%
# over exact at the speeds measured in the run; 87.9% of the even spread).
MOVE_GAIN = 0.03


def choose_split_near(speeds: Sequence[float], batch_size: int, sync_every: int, min_round_steps: int = 1,
                      min_share: int = 1, max_spread: float = 8.0, window: float = 0.25,
                      gap: float = GAP_HINT) -> tuple[int, BalancedSplit | None]:
    """DiLoCo when the plan chose H (the user did not): H itself when a split of it comes within
    MOVE_GAIN of exact, else the H within +-`window` of it whose split comes closest to exact (the
    nearest H among equals) where that is MOVE_GAIN closer than H's own. The usable splits of H
    are its divisors, so one H can leave the slow rank 11%
    over an exact split where its neighbour fits (H = 10 at speeds 3.6x apart: k = 5, 6/6/7/1 and
    the rest waiting; H = 12: k = 4, 5/5/5/1). Returns (H, the split or None)."""
    first = choose_split(speeds, batch_size, True, sync_every, min_round_steps, min_share, max_spread, gap)
    if not needs_balance(speeds) or (first is not None and first.gap <= MOVE_GAIN):
        return sync_every, first
    best_h, best = sync_every, first
    lo, hi = max(1, math.floor(sync_every * (1 - window))), math.ceil(sync_every * (1 + window))
    for h in sorted(range(lo, hi + 1), key=lambda h: (abs(h - sync_every), h)):
        c = choose_split(speeds, batch_size, True, h, min_round_steps, min_share, max_spread, gap)
        if c is not None and (best is None or c.gap < best.gap - 1e-9):
            best_h, best = h, c
    if first is not None and best.gap > first.gap - MOVE_GAIN:
        return sync_every, first  # not worth moving the plan's H for
    return best_h, best


@dataclass(frozen=True)
class CarriedSplit:
    """`--strategy auto` on uneven shares switching from ddp to diloco (`session/auto.py`): the
    shares diloco runs from the next step on."""

    micro_batches: int  # micro-batches of the script's batch per step, all ranks together
    sync_every: int  # steps per round
    shares: tuple[int, ...]
    speeds: tuple[float, ...]  # in diloco's unit: micro-batches of the script's batch per second
    inner_steps: float  # inner steps per rank per round, on average (the sync rule's H, or near it)


def carry_to_diloco(speeds: Sequence[float], ddp_shares: Sequence[int], inner_steps: int, min_round_steps: int = 1,
                    min_share: int = 1, max_spread: float = 8.0, rechoose: bool = True) -> CarriedSplit:
    """The split a ddp session on shares (`ddp_shares`, parts of its step of world x B samples;
    `speeds` its estimates in parts per second) continues with as diloco at the sync rule's H
    (`inner_steps`), each micro-batch an inner step of the script's batch B. The speeds carry
    over, converted: a part was world x B / M samples, so v parts/s is v x world / M batches/s.

    `rechoose` (balancing on): the split `choose_split` makes for diloco from those speeds, which
    keeps H inner steps per rank per round exactly (k x world micro-batches a step, rounds of
    H / k steps); the even split (one a rank, rounds of H steps) where none is better. Off (shares
    fixed by the user): the same shares, now micro-batches, and rounds of H x world / M steps,
    rounded (at least `min_round_steps`), so a round holds about H inner steps per rank."""
    world, total = len(ddp_shares), sum(ddp_shares)
    if len(speeds) != world or total <= 0:
        raise ValueError(f"speeds {list(speeds)} and shares {list(ddp_shares)} must be one per rank, shares > 0")
    carried = tuple(float(v) * world / total for v in speeds)
    if rechoose:
        c = choose_split(carried, None, True, inner_steps, min_round_steps, min_share, max_spread)
        if c is None:  # even enough, or too coarse to beat the even split
            return CarriedSplit(world, max(inner_steps, 1), (1,) * world, carried, float(inner_steps))
        return CarriedSplit(c.micro_batches, c.sync_every, c.shares, carried, float(inner_steps))
    rounds = max(1, min_round_steps, round(inner_steps * world / total))
    return CarriedSplit(total, rounds, tuple(int(v) for v in ddp_shares), carried, rounds * total / world)


def scaled_steps(steps: int, k: int, multiple_of: int = 1) -> int:
    """A count of even steps as steps of k times the tokens: rounded up, at least one, and a
    multiple of `multiple_of` (DiLoCo's checkpoints fall on outer steps)."""
    n = max(1, math.ceil(steps / k))
    return max(multiple_of, math.ceil(n / multiple_of) * multiple_of)


def balance_line(node_speeds: dict[str, float], ranks_per_node: dict[str, int], choice: BalancedSplit | None,
                 session: bool = False, then: str | None = None) -> str:
    """The one line a balanced run starts with, e.g. "balancing: node-4 is 3.0x slower than
    node-1; micro-batches 6/6/6/2 of 20 a step (--no-balance to turn off)". `node_speeds`: per
    rank of each node; the shares are read in the same node order. `session` (`run`): the
    micro-batches are the script's batches (its `shard(batch_size=B)`), its step counts its own.
    `choice` None: only the first part (the caller says why there is no split). `then`: a clause
    said after the split (e.g. what auto's switch to diloco does with it)."""
    slow = min(node_speeds, key=lambda n: node_speeds[n])
    fast = max(node_speeds, key=lambda n: node_speeds[n])
    ratio = node_speeds[fast] / node_speeds[slow]
    many = sum(ranks_per_node.values()) > len(ranks_per_node)
    head = f"balancing: {slow} is {ratio:.1f}x slower than {fast}{' per rank' if many else ''}"
    if choice is None:
        return head
    shares = "/".join(str(v) for v in choice.shares)
    if session and choice.steps_per_step == 1 and choice.sync_every is None:  # ddp: one batch a rank, sized by share
        world = len(choice.shares)
        sizes = "/".join(f"{world * v / choice.micro_batches:.2f}".rstrip("0").rstrip(".") for v in choice.shares)
        how = f"batches {sizes} x the script's batch size a rank (shares {shares} of {choice.micro_batches}), " \
              f"each rank's gradient weighted by its batch"
    elif session:
        how = f"batches {shares} of {choice.micro_batches} a step (each of the script's batch size)"
    else:
        how = f"micro-batches {shares} of {choice.micro_batches} a step, {choice.batch_size} sequence" \
              f"{'s' if choice.batch_size != 1 else ''} each"
    if choice.steps_per_step > 1:  # diloco: fewer, larger steps; the rounds keep their inner steps
        how += (f"; a round is {choice.sync_every} step{'s' if choice.sync_every != 1 else ''} of "
                f"{choice.steps_per_step}x the {'samples' if session else 'tokens'} (the same inner steps)")
        how += "" if session else f", step counts divided by {choice.steps_per_step}"
    if then:
        how += f"; {then}"
    return f"{head}; {how} (--no-balance to turn off)"
