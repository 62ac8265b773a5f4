"""DiLoCo's sync rule applied again on the step time the run measures.

The launcher plans H, the wire format and the outer optimizer (`train/strategies/sync_rule.py`) on a
predicted inner step: a step time `vpscluster plan --calibrate` measured and cached, or else the
probe's FLOP/s times an assumed efficiency, which can be off by 2-3x on a CPU node (bench wan,
2026-12-05: 5.48 s planned, 2.03 s measured; the rule picked bf16 at H = 10 where the real step
asked for int8, and utilisation fell to 94%).

So the ranks measure: after the prediction's warm-up and correction window
(`train/prediction.py`: steps 4-8 of each session) they hold every rank's median compute per
step, gathered once. The slowest rank's is the real inner step. When it is off the plan's by
more than `TOLERANCE` (either way), every rank applies the same rule to the same figures
(`plan_again`, pure) and so switches to the same settings at the same step; only the keys the
user left open (`ReplanInputs.keys`) change. Within the tolerance the plan stands, so a run
never flips between two settings on noise.

The switch (`DiLoCoStrategy.retune`) waits for the syncs in flight, then the next outer sync
comes at the next multiple of the new H. The settings are kept in the strategy's checkpoint,
so a resumed run starts from them (and measures again).
"""

from __future__ import annotations

from typing import Any

from vpscluster.train.strategies import sync_rule

TOLERANCE = 0.25  # the measured step may differ this much (relative) from the plan's before it is re-made


def measured_step(summaries: list[dict[str, Any] | None]) -> float | None:
    """The slowest rank's median compute per step in the correction window (None: none measured)."""
    times = [s["window"]["compute_median_s"] for s in summaries
             if s and s.get("window") and s["window"].get("compute_median_s")]
    return max(times) if times else None


def plan_again(inputs, step_s: float, world_size: int, current: dict[str, Any],
               overlap_steps: int = 0) -> tuple[dict[str, Any], str] | None:
    """The rule's settings on the measured step `step_s` and the one-line reason, or None when
    the plan stands (the step is within TOLERANCE of the plan's, or the rule chooses what runs).

    `inputs`: `train.config.ReplanInputs`; `current`: the strategy's settings now (its
    sync_every, wire_dtype, outer_lr, outer_momentum, outer_warmup); `overlap_steps`: the
    strategy's τ, as the launcher planned with it. Only `inputs.keys` change."""
    if not inputs or not inputs.keys or step_s is None or step_s <= 0 or world_size <= 1:
        return None
    off = step_s / inputs.step_seconds - 1.0
    if abs(off) <= TOLERANCE:
        return None
    c = sync_rule.choose_sync(inputs.bandwidth_bytes_s, step_s, inputs.num_params, world_size,
                              latency_s=inputs.latency_s, choices=tuple(inputs.choices), wires=tuple(inputs.wires),
                              overlap_steps=overlap_steps, egress=egress_of(inputs))
    new = {k: v for k, v in c.settings().items() if k in inputs.keys and current.get(k) != v}
    if not new:
        return None
    was = f"H={current.get('sync_every')} {current.get('wire_dtype')}"
    reason = (f"measured {step_s:.2f} s per inner step against {inputs.step_seconds:.2f} s planned "
              f"({inputs.step_source}, {off:+.0%}): {was} -> {c.reason}")
    return new, reason


def egress_of(inputs) -> sync_rule.EgressBudget | None:
    """The launcher's egress quotas and run length, as the rule takes them (None: no quota)."""
    quotas = tuple((float(b), float(p)) for b, p in inputs.egress_quotas)
    return sync_rule.EgressBudget(quotas, inputs.run_steps, inputs.run_seconds) if quotas else None


def replannable(t: Any) -> bool:
    """Does this run (`t`: the Trainer) re-make its sync plan on the measured step? DiLoCo with
    rule inputs from the launcher, on even shares (with uneven ones a loop step is several inner
    steps: the window would not measure one)."""
    s = t.cfg.strategy
    return s.launcher.replan is not None and hasattr(t.strategy, "retune") and not s.micro_batches \
        and t.ctx.world_size > 1


def window_full(t: Any) -> None:
    """The correction window is full: every rank's summary gathered once (as communication);
    rank 0 records the corrected prediction (train/prediction.py), and every rank re-makes the
    sync plan where the measured step is far off the planned one."""
    from vpscluster.train import prediction
    from vpscluster.train.shares import look_every
    from vpscluster.train.strategies.diloco import RETUNABLE

    session = t.session
    with t.strategy.comm.timed(0):
        summaries = session.all_gather_object(prediction.rank_summary(t.samples))
    session.book_off_comm()
    if session.is_main and t.prediction is not None:
        doc = prediction.compare(t.prediction, summaries, comm_every_step=t.strategy.steps_per_sync() == 1)
        session.events.emit("prediction", step=session.steps, predicted=doc["predicted"], measured=doc["measured"],
                            error=doc["error"], corrected=doc["corrected"])
    if not replannable(t):
        return
    s = t.cfg.strategy
    step_s = measured_step(summaries)
    before = {k: getattr(s, k) for k in RETUNABLE}
    again = plan_again(s.launcher.replan, step_s, session.world_size, before, s.overlap_steps)
    if again is None:
        return
    settings, reason = again
    t.strategy.retune(settings)  # the same figures on every rank: the same settings, this step
    session.look_every = look_every(s.rebalance_every, s.sync_every if t.strategy.micro_batches_are_steps else None)
    t.replanned = {"step": session.steps, "planned_step_seconds": s.launcher.replan.step_seconds,
                   "planned_from": s.launcher.replan.step_source, "measured_step_seconds": step_s,
                   "before": before, "after": {k: getattr(s, k) for k in RETUNABLE}, "reason": reason}
    session.events.emit("replan", **t.replanned)
