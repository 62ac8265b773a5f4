"""Per-rank shares of the global batch on uneven and changing nodes (pure Python, no torch).

A step's global batch is `total` micro-batches of the same shape. Rank r runs `shares[r]` of
them; the shares always sum to `total`, so the global batch - and with the loss scaled by
world/total per micro-batch, the averaged gradient - is exactly that of an even split (see
`train/step_runner.py`). Only *who* computes which micro-batch changes.

- `split(speeds, total, ...)`: the integer shares that minimise the predicted step time
  max_r(shares[r] / speeds[r]) - every rank starts at `min_share`, then each further
  micro-batch goes to the rank that would finish it first (ties: the lower rank). Greedy is
  optimal for this makespan and deterministic, so every rank computes the same shares from the
  same speeds.
- The spread rule (`max_spread`): speeds are clamped from below to max(speeds) / max_spread
  before splitting. A node 20x slower than the fastest is treated as max_spread x slower: it
  keeps a share (and a voice in DiLoCo's token-weighted average) instead of being starved, and
  the others wait for it at most a bounded time. 0 disables the rule.
- `ShareController`: every `rebalance_every` steps (and once early in every session, at its
  third step; a session's first step, with its one-off costs, is not measured) the ranks all-gather (compute seconds, micro-batches)
  measured since the last look; the controller turns them into speeds (micro-batches per
  compute second), smooths them with an exponential moving average (`DAMPING`: the weight of
  the new measurement; the starting speeds are first rescaled to the measured unit by the mean
  ratio of the first measurements) - except that a measurement `JUMP` times above or below the
  estimate replaces it outright (a node whose CPU was cut to a third is a new node, not noise:
  averaging would take several looks to get there, each on a stale split) - and re-splits only when the new shares are predicted to be at least
  `THRESHOLD` faster than the current ones under the same estimates (hysteresis: noise that
  would move a micro-batch back and forth is ignored). Changes happen at step boundaries only.
  A rank with no micro-batches in the window has no measurement and keeps its estimate.
  Every rank feeds the same gathered figures into the same code, so shares agree everywhere.
- `split_gap`: what the granularity costs. Shares are whole micro-batches, so 0.6/0.3/0.15 cores
  with 12 micro-batches can only be 8:3:1, a step 17% longer than an exact split; with one
  sequence per micro-batch (24) it is 14:7:3, 2% longer. The trainer reports the gap with each
  re-split and the launcher suggests finer micro-batches when it is over `GAP_HINT`.
- `look_every`: how many steps between looks. DiLoCo's looks fall on whole rounds (a multiple
  of H), so every window holds the same number of syncs; a window with a sync and the next
  without would swing the measured speeds past `THRESHOLD` and flip a tie back and forth.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

from vpscluster.errors import UserError

DAMPING = 0.5  # weight of a new measurement in the speed estimate
THRESHOLD = 0.05  # re-split only when predicted >= 5% faster than the current shares
JUMP = 1.5  # a measured speed this many times off the estimate replaces it (a real change)
GAP_HINT = 0.10  # a split this much slower than an exact one is worth finer micro-batches


def clamp_speeds(speeds: Sequence[float], max_spread: float) -> list[float]:
    """The spread rule: no speed below max(speeds) / max_spread (0 = no rule)."""
    if any(s <= 0 for s in speeds):
        raise UserError(f"speeds must be positive, got {list(speeds)}")
    top = max(speeds)
    if max_spread and max_spread > 0:
        return [max(s, top / max_spread) for s in speeds]
    return [float(s) for s in speeds]


def split(speeds: Sequence[float], total: int, min_share: int = 1, max_spread: float = 0.0) -> list[int]:
    """Integer micro-batch shares summing to `total` that minimise max(shares / speeds)."""
    n = len(speeds)
    if n == 0:
        raise ValueError("no ranks")
    if total < min_share * n:
        raise UserError(
            f"{total} micro-batches per step cannot give each of {n} ranks at least {min_share}; "
            f"raise --micro-batches to {min_share * n} or lower strategy.min_share"
        )
    s = clamp_speeds(speeds, max_spread)
    shares = [min_share] * n
    for _ in range(total - min_share * n):
        best = min(range(n), key=lambda r: ((shares[r] + 1) / s[r], r))
        shares[best] += 1
    return shares


def even(world: int, total: int) -> list[int]:
    """The even split: total // world each, the remainder to the lowest ranks."""
    base, extra = divmod(total, world)
    return [base + (1 if r < extra else 0) for r in range(world)]


def predicted_step(shares: Sequence[int], speeds: Sequence[float]) -> float:
    """Seconds per step when rank r runs shares[r] micro-batches at speeds[r] per second."""
    return max(sh / sp for sh, sp in zip(shares, speeds))


def split_gap(shares: Sequence[int], speeds: Sequence[float], max_spread: float = 0.0) -> float:
    """How much slower whole micro-batches are than an exact (fractional) split of the same
    work: predicted_step(shares) / (total / sum(speeds)) - 1, with the spread rule applied. 0.14
    means the step takes 14% longer than if every rank could finish at the same moment; more,
    smaller micro-batches per step make the split finer."""
    eff = clamp_speeds(speeds, max_spread)
    return predicted_step(shares, eff) / (sum(shares) / sum(eff)) - 1


def look_every(rebalance_every: int, sync_every: int | None = None) -> int:
    """Steps between the controller's looks. DiLoCo (`sync_every` = H): rounded up to whole
    rounds, so every window holds the same number of outer syncs. A sync's own work (encode,
    decode, outer step) counts as compute, so windows of 5 steps at H = 10 - one with the sync,
    the next without - measured speeds 10-30% apart in turn and flipped a 7:4:1 / 8:3:1 tie
    eleven times in 90 s (bench uneven, 2026-12-04)."""
    if not sync_every or sync_every <= 1:
        return rebalance_every
    return -(-rebalance_every // sync_every) * sync_every


def offsets(shares: Sequence[int]) -> list[int]:
    """The first micro-batch (in the step's global order) each rank runs."""
    out, acc = [], 0
    for sh in shares:
        out.append(acc)
        acc += sh
    return out


def batch_sizes(shares: Sequence[int], samples: int) -> list[int]:
    """A ddp session's step (`session/shard.py`): `samples` (world x the script's batch size)
    cut into one batch per rank in proportion to its share, every batch at least one sample
    (DDP needs every rank in each all-reduce), the sizes summing to `samples` exactly. Whole
    samples: the floor of each exact part, then the samples left over one each to the largest
    remainders (ties: the lower rank); a rank lifted to one sample is paid for by the rank
    furthest over its exact part. Integer arithmetic, so every rank computes the same sizes."""
    world, total = len(shares), sum(shares)
    if samples < world:
        raise UserError(f"a step of {samples} samples cannot give each of {world} ranks one; "
                        f"raise shard(batch_size=...)")
    if total <= 0 or min(shares) < 0:
        raise ValueError(f"shares {list(shares)} must be >= 0 with a positive sum")
    sizes = [max(1, samples * sh // total) for sh in shares]
    left = samples - sum(sizes)
    if left > 0:  # fewer than `world` samples: each to the largest remainder
        order = sorted(range(world), key=lambda r: (-(samples * shares[r] % total), r))
        for r in order[:left]:
            sizes[r] += 1
    while left < 0:  # lifting ranks to one sample overshot: take from the furthest over exact
        r = max((r for r in range(world) if sizes[r] > 1), key=lambda r: (sizes[r] * total - samples * shares[r], -r))
        sizes[r] -= 1
        left += 1
    return sizes


@dataclass
class ShareController:
    """Shares for every rank, re-split from measured speeds (see the module docstring)."""

    total: int
    speeds: list[float]  # current estimates, micro-batches per second (relative is enough)
    min_share: int = 1
    max_spread: float = 0.0
    balance: bool = True
    shares: list[int] = field(default_factory=list)
    rebalances: int = 0
    calibrated: bool = False  # speeds in micro-batches per second (after the first measurement)
    history: list[dict[str, Any]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.shares:
            self.shares = split(self.speeds, self.total, self.min_share, self.max_spread)

    @classmethod
    def start(cls, world: int, total: int, speeds: Sequence[float] | None, min_share: int,
              max_spread: float, balance: bool) -> "ShareController":
        if speeds is not None and len(speeds) != world:
            raise UserError(f"strategy.speeds has {len(speeds)} entries for {world} ranks; give one per rank")
        sp = [float(v) for v in speeds] if speeds is not None else [1.0] * world
        if speeds is None:
            shares = even(world, total)
            if min(shares) < min_share:
                raise UserError(
                    f"{total} micro-batches per step cannot give each of {world} ranks at least {min_share}; "
                    f"raise --micro-batches to {min_share * world} or lower strategy.min_share"
                )
            return cls(total, sp, min_share, max_spread, balance, shares=shares)
        return cls(total, sp, min_share, max_spread, balance)

    def observe(self, measured: Sequence[tuple[float, int]], step: int) -> bool:
        """Feed every rank's (compute seconds, micro-batches) since the last call; True when
        the shares changed. Does nothing when balancing is off."""
        if not self.balance:
            return False
        if not self.calibrated:
            # The starting speeds are relative figures in any unit: bring them to micro-batches
            # per second with the mean ratio of the first measurements, then smooth as usual.
            ratios = [m / sec / self.speeds[r] for r, (sec, m) in enumerate(measured) if m > 0 and sec > 0]
            if not ratios:
                return False
            factor = sum(ratios) / len(ratios)
            self.speeds = [v * factor for v in self.speeds]
            self.calibrated = True
        for r, (seconds, micro) in enumerate(measured):
            if micro > 0 and seconds > 0:
                now = micro / seconds
                jumped = not 1 / JUMP < now / self.speeds[r] < JUMP
                self.speeds[r] = now if jumped else (1 - DAMPING) * self.speeds[r] + DAMPING * now
        proposal = split(self.speeds, self.total, self.min_share, self.max_spread)
        if proposal == self.shares:
            return False
        eff = clamp_speeds(self.speeds, self.max_spread)
        now, new = predicted_step(self.shares, eff), predicted_step(proposal, eff)
        if new > now * (1 - THRESHOLD):
            return False
        self.history.append({"step": step, "from": list(self.shares), "to": proposal,
                             "predicted_speedup": round(now / new, 4)})
        self.shares = proposal
        self.rebalances += 1
        return True

    def split_gap(self) -> float:
        """The current shares' cost of whole micro-batches under the current estimates."""
        return split_gap(self.shares, self.speeds, self.max_spread)

    def state_dict(self) -> dict[str, Any]:
        return {"speeds": list(self.speeds), "shares": list(self.shares), "rebalances": self.rebalances,
                "history": list(self.history), "calibrated": self.calibrated}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if len(state["shares"]) != len(self.shares) or sum(state["shares"]) != self.total:
            raise UserError(
                f"checkpoint was taken with shares {state['shares']}, this run has {len(self.shares)} ranks and "
                f"{self.total} micro-batches per step; resume with the same ranks and --micro-batches"
            )
        self.speeds = [float(v) for v in state["speeds"]]
        self.shares = [int(v) for v in state["shares"]]
        self.rebalances = int(state["rebalances"])
        self.history = list(state.get("history", []))
        self.calibrated = bool(state.get("calibrated", False))


def node_speeds_from_probe(probe: dict | None, ranks_per_node: dict[str, int]) -> dict[str, float] | None:
    """Each node's per-rank starting speed from a probe (`probe.json`): the node's speed divided
    among the ranks it runs.

    A node's speed is its measured matmul FLOP/s (`flops`; taken under the node's cgroup CPU
    quota, so a node capped to 0.3 cores measures about 0.3 of a core), times its GPUs when it
    was measured on one of them. Where some node has no FLOP/s figure, every node falls back to
    the CPU share it really gets (`cpu_share`: affinity capped by the quota, in cores), so all
    speeds are in one unit. None when the probe does not cover every node: the caller starts
    even.
    """
    nodes = {n.get("name"): n for n in (probe or {}).get("nodes", []) or [] if isinstance(n, dict)}
    if not ranks_per_node or any(not isinstance(nodes.get(name), dict) for name in ranks_per_node):
        return None

    def positive(v) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0

    def flops(facts: dict) -> float | None:
        if not positive(facts.get("flops")):
            return None
        gpus = [g for g in facts.get("gpus") or [] if isinstance(g, dict)]
        per_device = facts.get("flops_device") == "cuda" and gpus
        return float(facts["flops"]) * (len(gpus) if per_device else 1)

    speed = {name: flops(nodes[name]) for name in ranks_per_node}
    if any(v is None for v in speed.values()):
        shares = {name: nodes[name].get("cpu_share") for name in ranks_per_node}
        if not all(positive(v) for v in shares.values()):
            return None
        speed = {name: float(v) for name, v in shares.items()}
    return {name: speed[name] / max(1, ranks) for name, ranks in ranks_per_node.items()}


def rank_speeds(node_of_rank: Sequence[str], node_speeds: dict[str, float]) -> list[float] | None:
    """Per-rank speeds in rank order, from the node each rank runs on (None: a node is missing)."""
    if any(n not in node_speeds for n in node_of_rank):
        return None
    return [float(node_speeds[n]) for n in node_of_rank]
