"""DiLoCo's defaults from the plan: H, the wire format and the outer optimizer, as one pure rule.

Inputs are plan quantities only: the ring's bottleneck bandwidth (bytes/s), the predicted
compute time of one inner step (the slowest rank's), the model's parameter count and the world
size (optionally the ring's per-step latency). Nothing is measured here, so the choice is a
pure function of the plan, testable on a grid.

The rule (DiLoCo, Douillard et al. 2023; int8 pseudo-gradients as in INTELLECT-1, 2024):

1. One outer sync moves a ring all-reduce of the pseudo-gradient: each rank sends
   2(n-1)/n · P · b bytes, b = 4 (fp32), 2 (bf16) or 1 + 4/1024 (int8 with one fp32 scale per
   1024 values), plus 2(n-1) latencies. Its time is `sync_seconds(wire)`.
2. The sync may cost at most `FRACTION` (5%) of the compute of a round: sync ≤ 5% · H · step.
   That keeps compute utilization ≥ ~95% without overlap. With τ steps of overlap (the default
   τ = 1: the sync runs in the background and lands τ steps late) a sync that fits in
   `OVERLAP_HEADROOM` (80%) of τ steps is hidden and costs nothing: sync ≤ 0.8 · τ · step meets
   the target at any H. Measured (`vpscluster bench overlap`, BENCHMARKS.md: the reference
   nodes, H = 10, τ = 1, the link slowed row by row; two runs): with the sync at its link rate
   0.62-0.64 of a step utilisation was 98.1-98.4%, at 0.77-0.82 97.6%, at 0.91-0.96 96.1-96.6%,
   at 1.06-1.13 92.9-93.3%, at 1.20-1.29 (bf16) 93.2-93.9%. So 95% holds to about one step; past
   it the loss is worse than the exposed remainder predicts (the sync's own CPU work shares the
   node's quota: its thread was busy ~1.35x the link-rate time), and a longer sync counts whole,
   as without overlap. 0.8 keeps ~97.5%, with room for a step or link figure that is off.
3. Wire: the most precise format for which the smallest H worth running (`H_MIN`) already meets
   rule 2 — fp32 on fast links, then bf16; otherwise int8: on a slow link cutting the bytes 4×
   costs less quality than a 4× larger H (INTELLECT-1 found int8 pseudo-gradients lossless).
   A smaller H learns more per token: in the sandbox, H = 20 int8 ended +12.6% from ideal DDP at
   equal tokens, against +9.8% for H = 10 bf16 and +8.8% for H = 10 int8 (bench wan wanl14,
   wanl13, wanl12: 900 s, one run each).
4. H: the smallest allowed value ≥ H_MIN meeting rule 2 with that wire; when none does, the
   largest allowed (the link is too slow for the target; the reason says so).
5. Outer optimizer: Nesterov SGD, momentum 0.9, lr `outer_lr_for(H)`: 0.5 for rounds shorter than
   `OUTER_LR_LONG_H` (50) steps, DiLoCo's 0.7 (tuned at H = 500) from there on. At H = 10 on `small`
   with 4 replicas, 0.5 was ahead of 0.3, 0.7, 1.0 and plain averaging at every evaluation from the
   loss drop on, and 2.3% behind ddp at equal tokens after 800 steps against 5.9% for 0.7
   (BENCHMARKS.md, wan, "Outer lr 0.3, 0.5 and plain averaging at H = 10"); where between 10 and
   500 the optimum moves to 0.7 is not measured. An outer
   warm-up of `outer_warmup` syncs (see `train/strategies/diloco.py`): the outer lr ramps linearly over
   the first syncs and the first sync is plain averaging, so a model trained from scratch
   (whose first pseudo-gradients are huge and not in a consistent direction) does not
   overshoot. The warm-up covers about OUTER_WARMUP_STEPS inner steps, at least one sync.
6. Egress quotas (the cluster file's `egress_quota`, e.g. 20TB/month): the bytes a rank sends
   per inner step, sync_bytes / H, may not exceed what the tightest node's quota allows
   (`EgressBudget.per_step`: its share per rank, spread over the run or the quota's period,
   whichever is shorter, as `plan` checks it). Rules 2-4 choose for learning per token; where
   that choice would use up a quota, the wire is compressed first (bf16, int8: before a larger
   H, as in rule 3), then H grows: the smallest H, and at it the most precise wire, that keeps every
   quota (and rule 2's target, where rules 2-4 met it). When none does, the largest allowed H
   in the last wire, and the reason says the quota runs out. A quota is the one signal that
   trades learning per token for bytes: without one the rule sends what hides behind the
   overlap (bench wan: H = 10 int8 sent 39x fewer bytes per token than DDP in wanl15; H = 50
   int8 sent 176x fewer in wanl10 but took 2.2x the ideal row's time to the baseline's first
   target).

The step time is the plan's guess until the run measures it: the ranks apply this rule again on
the slowest rank's measured step after their first steps when it is far off the plan's
(`train/replan.py`), with the same allowed H values and wires, changing only the keys left open.

The inner optimizer's lr is not the plan's: DiLoCo scales it by 1/sqrt(replicas) from the run's
world (`train/strategies/diloco.py: inner_lr_scale`).

Slower link → the fp32 H needed grows → the wire moves fp32 → bf16 → int8 and H never shrinks
(monotone; `tests/test_plan_sync_rule.py` checks it over 10 Mbit/s … 10 Gbit/s and model sizes).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from vpscluster.train.strategies import sparse_wire

FRACTION = 0.05  # the sync's share of a round's compute
H_MIN = 10  # below this DiLoCo is DDP with extra steps; no rule picks less
SYNC_EVERY_CHOICES = (10, 20, 25, 50, 100, 200, 250, 500, 1000)
WIRES = ("fp32", "bf16", "int8")  # most precise first
INT8_BLOCK = 1024
OUTER_LR_SHORT = 0.5  # H < OUTER_LR_LONG_H: measured best at H = 10
OUTER_LR = 0.7  # DiLoCo's, at H = 500
OUTER_LR_LONG_H = 50
OUTER_MOMENTUM = 0.9
OUTER_WARMUP_STEPS = 100  # inner steps the outer warm-up spans (at least one sync)
OVERLAP_HEADROOM = 0.8  # an overlapped sync this share of its τ steps long (or less) is hidden
# The StrategyConfig keys this rule chooses (each only where the user did not set it).
KEYS = ("sync_every", "wire_dtype", "outer_lr", "outer_momentum", "outer_warmup")


@dataclass(frozen=True)
class EgressBudget:
    """Rule 6's inputs: every node's egress quota as (bytes each of its ranks may send, the
    quota's period in seconds), and how long the run is, in inner steps and, when a time budget
    is set, seconds (0: not known)."""

    quotas: tuple[tuple[float, float], ...]
    run_steps: int = 0
    run_seconds: float = 0.0

    def per_step(self, step_seconds: float) -> float:
        """The most one rank may send per inner step and keep every quota: within one period
        the run sends for min(run, period) seconds."""
        run = math.inf
        if self.run_steps > 0:
            run = self.run_steps * step_seconds
        if self.run_seconds > 0:
            run = min(run, self.run_seconds)
        return min(b * step_seconds / min(run, period) for b, period in self.quotas)


def wire_bytes_per_param(wire: str) -> float:
    if wire in sparse_wire.SPARSE_WIRES:  # chunked top-k, all-gathered (`train/strategies/sparse_wire.py`)
        return sparse_wire.bytes_per_param(wire)
    return {"fp32": 4.0, "bf16": 2.0, "int8": 1.0 + 4.0 / INT8_BLOCK}[wire]


def sync_bytes(num_params: float, world_size: int, wire: str) -> float:
    """Bytes each rank sends in one outer sync (a ring all-reduce of the encoded pseudo-gradient)."""
    if world_size <= 1:
        return 0.0
    if wire in sparse_wire.SPARSE_WIRES:  # an all-gather: the buffer to each of the world - 1 peers
        return sparse_wire.sync_bytes(num_params, world_size, wire)
    return 2.0 * (world_size - 1) / world_size * num_params * wire_bytes_per_param(wire)


def sync_seconds(num_params: float, world_size: int, wire: str, bandwidth_bytes_s: float,
                 latency_s: float = 0.0) -> float:
    if world_size <= 1:
        return 0.0
    return sync_bytes(num_params, world_size, wire) / bandwidth_bytes_s + 2 * (world_size - 1) * latency_s


@dataclass(frozen=True)
class SyncChoice:
    sync_every: int
    wire_dtype: str
    outer_lr: float
    outer_momentum: float
    outer_warmup: int  # outer syncs over which the outer lr ramps up (1 = the first is plain averaging)
    sync_seconds: float  # one sync in the chosen wire
    comm_fraction: float  # sync_seconds / (H * step_seconds): the network's share of a round
    meets_target: bool  # hidden, or comm_fraction <= FRACTION
    reason: str
    hidden: bool = False  # the sync fits behind the overlap's steps (rule 2)
    egress_bound: bool = False  # an egress quota moved the wire or H (rule 6)

    def settings(self) -> dict:
        """The StrategyConfig keys this rule sets."""
        return {"sync_every": self.sync_every, "wire_dtype": self.wire_dtype, "outer_lr": self.outer_lr,
                "outer_momentum": self.outer_momentum, "outer_warmup": self.outer_warmup}


def outer_lr_for(sync_every: int) -> float:
    return OUTER_LR_SHORT if sync_every < OUTER_LR_LONG_H else OUTER_LR


def outer_warmup_for(sync_every: int) -> int:
    return max(1, math.ceil(OUTER_WARMUP_STEPS / sync_every))


def choose_sync(bandwidth_bytes_s: float, step_seconds: float, num_params: float, world_size: int,
                latency_s: float = 0.0, choices: tuple[int, ...] | list[int] = SYNC_EVERY_CHOICES,
                fraction: float = FRACTION, wires: tuple[str, ...] = WIRES, overlap_steps: int = 0,
                egress: EgressBudget | None = None) -> SyncChoice:
    """H, wire and outer optimizer for DiLoCo on this plan (see the module's rule).

    `choices`: the H values allowed (e.g. those dividing checkpoint_every; one value when the user
    fixed H); `wires`: the formats allowed, most precise first (one when the user fixed it);
    `overlap_steps`: τ, the steps an outer sync runs behind (0 = blocking; capped at H - 1);
    `egress`: the nodes' egress quotas (rule 6; None or no quotas: no limit)."""
    if bandwidth_bytes_s <= 0 or step_seconds <= 0 or num_params <= 0:
        raise ValueError("bandwidth, step time and model size must be positive")
    allowed = sorted(h for h in set(choices) if h >= 1) or [H_MIN]
    worth = [h for h in allowed if h >= H_MIN] or [allowed[-1]]

    def seconds(wire: str) -> float:
        return sync_seconds(num_params, world_size, wire, bandwidth_bytes_s, latency_s)

    def hidden(wire: str, h: int) -> bool:  # behind τ steps of compute, with headroom
        tau = min(overlap_steps, h - 1)
        return tau >= 1 and seconds(wire) <= OVERLAP_HEADROOM * tau * step_seconds

    def meets(wire: str, h: int) -> bool:
        return hidden(wire, h) or seconds(wire) <= fraction * h * step_seconds * (1 + 1e-9)

    wire = next((w for w in wires[:-1] if meets(w, worth[0])), wires[-1])
    h = next((h for h in worth if meets(wire, h)), worth[-1])
    allowance = egress.per_step(step_seconds) if egress and egress.quotas else None

    def within(wire: str, h: int) -> bool:  # rule 6
        return allowance is None or sync_bytes(num_params, world_size, wire) / h <= allowance * (1 + 1e-9)

    bound = not within(wire, h)
    if bound:  # the smallest H, then the most precise wire, from rules 2-4's choice on; rule 2 kept where it was met
        pairs = [(x, w) for x in worth if x >= h for w in wires[wires.index(wire):]]
        met = meets(wire, h)
        h, wire = next(((x, w) for x, w in pairs if within(w, x) and (meets(w, x) or not met)), (worth[-1], wires[-1]))
    t = seconds(wire)
    share = t / (h * step_seconds)
    hid = hidden(wire, h)
    ok = meets(wire, h)
    mbit = bandwidth_bytes_s * 8 / 1e6
    why_wire = ("the wire format as set" if len(wires) == 1 else
                "the link is fast enough for full precision" if wire == "fp32" else
                "bf16 halves the bytes and is enough" if wire == "bf16" else
                "the link is slow: int8 cuts the bytes 4x (lossless in INTELLECT-1) before H grows")
    tau = min(overlap_steps, h - 1)
    cost = (f"hidden behind {tau} overlapped step{'s' if tau > 1 else ''} of {step_seconds:.2f} s" if hid else
            f"{share:.1%} of {h} steps of {step_seconds:.2f} s ({'within' if ok else 'above'} the {fraction:.0%} target)")
    sent = sync_bytes(num_params, world_size, wire)
    if bound:
        why_wire = (f"the egress quota allows {allowance / 1e6:.3g} MB per rank per inner step and H={h} {wire} "
                    + (f"sends {sent / h / 1e6:.3g}" if within(wire, h) else
                       f"still sends {sent / h / 1e6:.3g}: the quota runs out before the run ends"))
    reason = (f"H={h} {wire}: a sync of {sent / 1e6:.1f} MB per rank "
              f"takes {t:.2f} s at {mbit:.0f} Mbit/s, {cost}; {why_wire}")
    return SyncChoice(sync_every=h, wire_dtype=wire, outer_lr=outer_lr_for(h), outer_momentum=OUTER_MOMENTUM,
                      outer_warmup=outer_warmup_for(h), sync_seconds=t, comm_fraction=share, meets_target=ok,
                      reason=reason, hidden=hid, egress_bound=bound)


def choose_measured(step_seconds: float, ddp_comm_seconds: float, num_params: float, world_size: int,
                    bandwidth_bytes_s: float, latency_s: float = 0.0, egress: "EgressBudget | None" = None,
                    ddp_bytes_per_step: float = 0.0, overlap_steps: int = 1,
                    choices=SYNC_EVERY_CHOICES, wires=WIRES) -> tuple[dict, str]:
    """`--strategy auto` for a user's script (`vpscluster run`), decided on its first DDP steps:
    the slowest rank's measured compute per step (`step_seconds`) and DDP's exposed all-reduce
    time per step (`ddp_comm_seconds`), the model's parameter count, and the launcher's ring
    (bandwidth, latency) and egress quotas. Returns the StrategyConfig keys to run with and the
    one-line reason; a pure function, so every rank that calls it on the same figures agrees.

    DDP stays where its exposed communication is within the sync rule's target share of a step
    (`FRACTION`: nothing is gained by syncing less, and DDP learns the most per
    sample) and its bytes keep every egress quota; otherwise DiLoCo with the sync rule's H,
    wire and outer optimizer on the measured step (`choose_sync`)."""
    if world_size <= 1:
        return {"name": "ddp"}, "ddp: one rank, nothing to synchronise"
    share = ddp_comm_seconds / (step_seconds + ddp_comm_seconds) if step_seconds + ddp_comm_seconds > 0 else 0.0
    measured = (f"measured {step_seconds * 1000:.3g} ms compute and {ddp_comm_seconds * 1000:.3g} ms exposed "
                f"all-reduce per DDP step")
    allowance = egress.per_step(step_seconds + ddp_comm_seconds) if egress and egress.quotas else None
    over_quota = allowance is not None and ddp_bytes_per_step > allowance
    if share <= FRACTION and not over_quota:
        return {"name": "ddp"}, (f"ddp: {measured}: communication is {share:.0%} of a step (target "
                                 f"<= {FRACTION:.0%}), nothing is gained by syncing less")
    c = choose_sync(bandwidth_bytes_s, step_seconds, num_params, world_size, latency_s=latency_s,
                              choices=tuple(choices), wires=tuple(wires), overlap_steps=overlap_steps, egress=egress)
    why = (f"ddp would send {ddp_bytes_per_step / 1e6:.3g} MB per rank per step, over the egress quota's "
           f"{allowance / 1e6:.3g} MB" if over_quota else f"communication is {share:.0%} of a DDP step")
    head, tail = c.reason.split(": ", 1)  # "H=10 int8", what the sync costs and why that wire
    return {"name": "diloco", "compress": "none", **c.settings()}, f"diloco {head}: {measured}: {why}; {tail}"
