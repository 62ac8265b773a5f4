"""`--strategy auto` for a user's script: DDP first, measured, then the plan's choice.

The launcher knows the cluster (the ring's bandwidth and latency, egress quotas: `AutoInputs` in
session.json); the session knows the model (`s.setup(model)`: its parameter count) and can time
it. A user's model has no FLOP count the plan could predict a step from, so the session measures
one: it trains the first steps with DDP, and after `WARMUP_STEPS` + `WINDOW_STEPS` steps every
rank gathers every rank's median compute and exposed all-reduce time per step over the window.
The slowest rank's figures go into one pure rule (`train.strategies.sync_rule.choose_measured`), so every rank
decides alike at the same step, with no broadcast: DDP stays when its communication is within
the sync rule's target share of a step and keeps the egress quotas, else DiLoCo with the sync
rule's H, wire and outer optimizer on the measured step.

Switching from DDP to DiLoCo mid-run needs no help from the script: `setup` returned a thin
module (`Switchable`) whose forward goes to whichever wrapper is active (the DDP wrapper, then
the plain model that DiLoCo trains), with the same parameters throughout, so the optimizer the
script built keeps working. Every rank holds the same weights after a DDP step, so DiLoCo starts
from them as from a fresh setup. The choice goes into checkpoints; a resumed run takes it again
at once instead of measuring.

Uneven shares (`--micro-batches`, or balancing by default) carry over: under ddp they are parts
of a step of world x B samples, under diloco micro-batches of B, each an inner step. When the
choice is diloco, `carry_shares` converts the speeds the ddp steps measured to diloco's unit and
picks its split (`plan.balance.carry_to_diloco`); the split goes into the choice, so a resume
replays it. The data position is kept in samples (`session/shard.py`), so the step that changes
size mid-epoch skips and repeats no sample.
"""

from __future__ import annotations

import dataclasses
import statistics
from typing import Any

from torch import nn

WARMUP_STEPS = 2  # the first steps (allocations, DDP's bucket rebuild) are not measured
WINDOW_STEPS = 4  # steps measured; the choice is made at the end of step WARMUP_STEPS + WINDOW_STEPS


class Switchable(nn.Module):
    """What `setup` returns under `--strategy auto`: the user's model (its parameters, modes and
    attributes) whose forward runs through the active strategy's wrapper."""

    def __init__(self, model: nn.Module, active: nn.Module) -> None:
        super().__init__()
        self.module = model  # registered: parameters(), train()/eval(), to() reach the user's model
        object.__setattr__(self, "_active", active)  # not registered: DDP holds `model` itself

    def forward(self, *args, **kwargs):
        return self._active(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:  # the user's model's own attributes (e.g. a Transformers model's .config)
            return getattr(self._modules["module"], name)


@dataclasses.dataclass
class AutoChoice:
    """The session's pending or made choice (`Session.auto`)."""

    window: list[tuple[float, float, int]] = dataclasses.field(default_factory=list)  # (compute s, comm s, bytes)
    made: dict[str, Any] | None = None  # {"settings": {...}, "reason": str, "at_step": int, "measured": {...}}

    def record(self, steps_done: int, compute_s: float, comm_s: float, nbytes: int) -> bool:
        """Note one step's figures; True when the window is full (time to choose)."""
        if self.made is not None or steps_done <= WARMUP_STEPS:
            return False
        self.window.append((compute_s, comm_s, nbytes))
        return len(self.window) >= WINDOW_STEPS

    def summary(self) -> dict[str, float]:
        return {"compute_s": statistics.median(w[0] for w in self.window),
                "comm_s": statistics.median(w[1] for w in self.window),
                "bytes": statistics.median(w[2] for w in self.window)}


def choose(session, summaries: list[dict[str, float]]) -> dict[str, Any]:
    """The choice on every rank's window (gathered: the same list on every rank)."""
    from vpscluster.train.strategies import costs_for, sync_rule
    from vpscluster.train.strategies.sync_rule import choose_measured

    cfg = session.cfg
    inputs = cfg.auto
    model = session.unwrap()
    num_params = float(sum(p.numel() for p in model.parameters() if p.requires_grad))
    step_s = max(s["compute_s"] for s in summaries)
    comm_s = max(s["comm_s"] for s in summaries)
    nbytes = max(s["bytes"] for s in summaries)
    egress = (sync_rule.EgressBudget(tuple((float(b), float(p)) for b, p in inputs.egress_quotas), 0,
                                     cfg.time_budget_s or 0.0) if inputs.egress_quotas else None)
    s = cfg.strategy
    settings, reason = choose_measured(max(step_s, 1e-6), comm_s, num_params, session.world_size,
                                       inputs.bandwidth_bytes_s, inputs.latency_s, egress=egress,
                                       ddp_bytes_per_step=nbytes, overlap_steps=s.overlap_steps)
    made = {"settings": settings, "reason": f"{reason} (links: {inputs.source})" if inputs.source else reason,
            "at_step": session.steps,
            "measured": {"compute_s": step_s, "comm_s": comm_s, "bytes_per_step": nbytes, "num_params": num_params}}
    if session.shares is not None and costs_for(settings["name"]).micro_batches_are_steps:
        carry_shares(session, made)  # diloco chosen: ddp's parts of a step become its micro-batches
    return made


def carry_shares(session, made: dict[str, Any]) -> None:
    """Uneven shares under ddp, diloco chosen: the split diloco runs on (`plan.balance.carry_to_diloco`),
    from the speeds the ddp steps measured, in `made` (so a resume replays it, not re-derives it)."""
    from vpscluster.plan.balance import carry_to_diloco

    settings = made["settings"]
    cfg = dataclasses.replace(session.cfg.strategy, **settings)
    h = cfg.sync_every
    round_steps = max(cfg.fragments, min(cfg.overlap_steps, h - 1) + 1)
    shares = session.shares
    c = carry_to_diloco(shares.speeds, shares.shares, h, round_steps, cfg.min_share, cfg.max_spread,
                        rechoose=bool(cfg.balance))
    made["settings"] = {**settings, "sync_every": c.sync_every, "micro_batches": c.micro_batches}
    made["split"] = {"shares": list(c.shares), "speeds": list(c.speeds), "calibrated": shares.calibrated,
                     "inner_steps": c.inner_steps}
    r = "s" if c.sync_every != 1 else ""
    made["reason"] += (f"; uneven shares carried over: batches {'/'.join(map(str, c.shares))} of {c.micro_batches} "
                       f"a step (inner steps of the script's batch), rounds of {c.sync_every} step{r} "
                       f"({c.inner_steps:g} inner steps per rank on average)")


def switch(session, made: dict[str, Any]) -> None:
    """Run the chosen strategy from the next step on (every rank, at the same step)."""
    from vpscluster.train.strategies import get_strategy_class
    from vpscluster.session.dist import end_startup

    settings = made["settings"]
    if settings["name"] == session.strategy.name:
        return
    plain = session.unwrap()
    old = session.strategy
    old.comm.take()  # counted already (the step that chose took its figures)
    old.close()
    old.__dict__.pop("_ddp", None)
    cfg = dataclasses.replace(session.cfg.strategy, **settings)
    session.strategy = get_strategy_class(cfg.name)(cfg, session.ctx)
    active = session.strategy.setup(plain)
    object.__setattr__(session.model, "_active", active)
    end_startup(session.ctx, session.cfg.timeouts.train_collective_s, session.strategy.collective_groups())
    session.exporter.start_outer_count(getattr(session.strategy, "outer_steps", None))
    if session.shares is not None:
        _switch_shares(session, cfg, made.get("split"))


def _switch_shares(session, cfg, split: dict[str, Any] | None) -> None:
    """The shares from ddp's parts of a step to diloco's micro-batches (`carry_shares`), and the
    data position settled for the new step size: within the epoch it is kept in samples
    (`session/shard.py`), so no sample is skipped or read twice across the switch."""
    from vpscluster.train.shares import ShareController, look_every

    old = session.shares
    world = session.world_size
    if split is None or len(split["shares"]) != world:  # a checkpoint of another world: start even
        cfg.micro_batches = max(cfg.micro_batches, world * max(1, cfg.min_share))
        shares = ShareController.start(world, cfg.micro_batches, None, cfg.min_share, cfg.max_spread, bool(cfg.balance))
    else:
        shares = ShareController(cfg.micro_batches, [float(v) for v in split["speeds"]], cfg.min_share, cfg.max_spread,
                                 bool(cfg.balance), shares=[int(v) for v in split["shares"]],
                                 rebalances=old.rebalances, calibrated=bool(split["calibrated"]),
                                 history=list(old.history))
    session.shares = shares
    session.weighted, session._sizes = False, None  # diloco: micro-batches of the script's batch
    session.window = [0.0, 0]  # ddp's parts are another unit: the next look measures diloco's steps
    session.look_every = look_every(cfg.rebalance_every, cfg.sync_every)
    session._settle_data()
