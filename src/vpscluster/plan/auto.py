"""`--strategy auto`: the strategy and settings predicted fastest to N tokens at a low quality risk.

Every candidate (DDP plain / bf16 / PowerSGD; DiLoCo over H and wire precisions) is predicted
on the same resources. Candidates that do not fit in memory are dropped (unless none fits), so
are those that would use up a node's egress quota within the run (unless all would) and those
whose quality risk is high. Among the rest, the one with the least quality risk whose
time to train is within `TOLERANCE` of the fastest wins: DDP when communication is a small share
of its step (nothing is gained by leaving it), DiLoCo with the smallest sufficient H when
communication dominates. The reason is one line with the numbers behind it.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from vpscluster.plan import hierarchical
from vpscluster.train.strategies import sync_rule
from vpscluster.plan.predict import Prediction, Settings, predict, risk_label
from vpscluster.plan.resources import Resources
from vpscluster.plan.shapes import ModelSpec
from vpscluster.train.config import ReplanInputs
from vpscluster.train.strategies import STRATEGIES, costs_for

if TYPE_CHECKING:
    from vpscluster.cluster.node import Cluster
    from vpscluster.train.config import StrategyConfig, TrainConfig

TOLERANCE = 0.10  # a lower-risk candidate may be this much slower and still win
MAX_RISK = 3.0  # "medium" at most, unless nothing else exists
SYNC_EVERY_CHOICES = (5, 10, 20, 25, 50, 100, 200, 500)


def candidates(world_size: int, sync_every_choices=SYNC_EVERY_CHOICES, strategies=tuple(STRATEGIES),
               base: Settings | None = None) -> list[Settings]:
    """Every registered strategy over its typed choices (compress, wire dtype) and the H values."""
    base = base or Settings()
    return [c for name in strategies for c in costs_for(name).candidates(base, world_size, sync_every_choices)]


def choose(model: ModelSpec, res: Resources, tokens: float, efficiency: float,
           options: list[Settings] | None = None) -> tuple[Prediction, str, list[Prediction]]:
    """The chosen prediction, the one-line reason, and every candidate's prediction (fastest first)."""
    options = options or candidates(res.world_size)
    preds = sorted((predict(model, res, s, tokens, efficiency) for s in options), key=lambda p: p.time_to_train_seconds)
    if res.world_size <= 1:
        chosen = next(p for p in preds if p.settings.costs.is_plain(p.settings))
        return chosen, "one rank: nothing to synchronise, plain training", preds
    pool = [p for p in preds if p.fits] or preds
    pool = [p for p in pool if not p.quota_exceeded] or pool
    pool = [p for p in pool if p.quality_risk <= MAX_RISK] or pool
    fastest = pool[0]
    near = [p for p in pool if p.time_to_train_seconds <= fastest.time_to_train_seconds * (1 + TOLERANCE)]
    chosen = min(near, key=lambda p: (p.quality_risk, p.time_to_train_seconds))
    return chosen, _reason(chosen, preds, fits_any=any(p.fits for p in preds)), preds


def _reason(chosen: Prediction, preds: list[Prediction], fits_any: bool) -> str:
    ddp = next(p for p in preds if p.settings.costs.is_plain(p.settings))  # the plain baseline
    share = ddp.comm_seconds / ddp.step_seconds if ddp.step_seconds else 0.0
    mem = "" if fits_any else "; nothing fits in memory as configured — see the memory options"
    if chosen is ddp:
        return (f"ddp: communication is only {share:.0%} of a DDP step "
                f"({ddp.comm_seconds:.2f} s exposed of {ddp.step_seconds:.2f} s), so nothing is gained by syncing less{mem}")
    speedup = ddp.time_to_train_seconds / chosen.time_to_train_seconds
    if ddp.quota_exceeded and not chosen.quota_exceeded:
        first = min(ddp.quota_exceeded, key=lambda n: n.egress_exceeded_after_s)
        return (f"{chosen.settings.label()}: plain DDP would use up {first.name}'s egress quota after "
                f"{first.egress_exceeded_after_s / 3600:.1f} h of the run; {chosen.settings.label()} keeps every "
                f"quota (utilization {chosen.compute_utilization:.0%} vs {ddp.compute_utilization:.0%}){mem}")
    if chosen.settings.name == ddp.settings.name:  # a variant of the baseline (compression)
        return (f"{chosen.settings.label()}: plain DDP waits on the network for {share:.0%} of each step; "
                f"compression is {speedup:.1f}x faster to the token target at {risk_label(chosen.quality_risk)} quality risk{mem}")
    return (f"{chosen.settings.label()}: DDP would spend {share:.0%} of each step communicating; syncing every "
            f"{chosen.settings.sync_every} steps reaches the token target {speedup:.1f}x faster "
            f"(utilization {chosen.compute_utilization:.0%} vs {ddp.compute_utilization:.0%}) "
            f"at {risk_label(chosen.quality_risk)} quality risk{mem}")


def plan_inputs(cfg: "TrainConfig", cluster: "Cluster | None", probe: dict | None):
    """The model, resources and compute efficiency a training run is planned on. Without `probe`,
    the cluster's last saved probe is used when there is one."""
    from vpscluster.plan import steptime
    from vpscluster.plan.resources import gather_resources
    from vpscluster.plan.shapes import load_model

    model = load_model(cfg.preset, batch_size=cfg.micro_batch())
    if cluster is None:
        res = gather_resources(None, probe, nodes=cfg.nodes, local=True)
    else:
        if probe is None:
            try:  # the cluster's last probe, when `vpscluster probe` has run
                from vpscluster.probe.store import load_probe

                probe = load_probe(cluster)
            except ImportError:
                probe = None
        res = gather_resources(cluster, probe)
    probe_threads = next((n.get("torch_threads") for n in (probe or {}).get("nodes", [])
                          if isinstance(n, dict) and isinstance(n.get("torch_threads"), int)), None)
    # The step times `vpscluster plan --calibrate` cached for this model, as `plan` uses them.
    eff, _ = steptime.planned_efficiency(res, model, cluster, probe, threads=cfg.threads_per_rank or None,
                                         probe_threads=probe_threads)
    return model, res, eff


def given_keys(s: "StrategyConfig") -> set[str]:
    """For a StrategyConfig built in Python (no record of what was set): the rule's keys whose
    values differ from the defaults count as set."""
    from vpscluster.train.config import StrategyConfig

    d = StrategyConfig()
    return {k for k in sync_rule.KEYS if getattr(s, k) != getattr(d, k)}


def sync_choice(model: ModelSpec, res: Resources, efficiency: float, choices, wires,
                overlap_steps: int | None = None, run_steps: int = 0) -> "sync_rule.SyncChoice":
    """The sync rule (`train/strategies/sync_rule.py`) on this plan: the slowest node's step, the ring's
    bandwidth and latency, the model's size, the nodes' egress quotas over `run_steps` inner
    steps; `choices`/`wires`: the H values and formats allowed; `overlap_steps`: τ (None: the
    strategy's default)."""
    from vpscluster.train.config import StrategyConfig

    step_s, beta, alpha = rule_inputs(model, res, efficiency)
    tau = StrategyConfig().overlap_steps if overlap_steps is None else overlap_steps
    return sync_rule.choose_sync(beta, step_s, model.num_params(), res.world_size,
                                 latency_s=alpha, choices=choices, wires=wires, overlap_steps=tau,
                                 egress=egress_budget(res, run_steps))


def egress_budget(res: Resources, run_steps: int = 0, run_seconds: float = 0.0) -> "sync_rule.EgressBudget | None":
    """The nodes' egress quotas as the sync rule takes them (rule 6): each node's quota shared by
    its ranks; None when no node has one."""
    quotas = tuple((n.egress_quota_bytes / max(1, n.ranks), n.egress_quota_period_s) for n in res.nodes
                   if n.egress_quota_bytes and n.egress_quota_period_s)
    return sync_rule.EgressBudget(quotas, run_steps, run_seconds) if quotas else None


def rule_inputs(model: ModelSpec, res: Resources, efficiency: float) -> tuple[float, float, float]:
    """The sync rule's plan quantities: the slowest node's inner step (seconds), the ring's
    bottleneck bandwidth (bytes/s) and its per-hop latency (seconds)."""
    from vpscluster.plan.compute import node_compute
    from vpscluster.plan.predict import ring_for

    step_s = max(node_compute(model, node, efficiency).seconds for node in res.nodes)
    ring = ring_for(res)
    return step_s, ring.beta_bytes_s, ring.alpha_s


def plan_diloco(cfg: "TrainConfig", model: ModelSpec, res: Resources, efficiency: float,
                given: set[str] | frozenset[str] = frozenset(), strategy: "StrategyConfig | None" = None,
                ) -> "StrategyConfig":
    """cfg.strategy as DiLoCo with the sync rule's H, wire and outer optimizer (`train/strategies/sync_rule.py`)
    for every one of those keys not in `given` (what the user set wins); `launcher.planned` and
    `launcher.planned_reason` record what was chosen and why. `strategy`: the settings to start from
    (default cfg.strategy).

    H is taken among values that divide `checkpoint_every` (checkpoints must fall on outer steps),
    leave at least 4 outer steps in `max_steps` and are at least `fragments` (a run too short for
    the rule's values gets the largest such divisor)."""
    s = strategy or cfg.strategy
    todo = [k for k in sync_rule.KEYS if k not in given]
    if res.world_size <= 1 or not todo:
        return dataclasses.replace(s, name="diloco").with_launcher(planned=[], planned_reason=None, replan=None)
    if "sync_every" in given:
        hs = [s.sync_every]
    else:
        limit = max(1, cfg.max_steps // 4)

        def fits(h: int) -> bool:
            return cfg.checkpoint_every % h == 0 and s.fragments <= h <= limit

        # The rule's values; for a short run any divisor of checkpoint_every that fits.
        hs = ([h for h in sync_rule.SYNC_EVERY_CHOICES if fits(h)] or [h for h in range(1, limit + 1) if fits(h)]
              or [s.sync_every])
    wires = (s.wire_dtype,) if "wire_dtype" in given else sync_rule.WIRES
    step_s, beta, alpha = rule_inputs(model, res, efficiency)
    egress = egress_budget(res, cfg.max_steps, cfg.time_budget_s or 0.0)
    c = sync_rule.choose_sync(beta, step_s, model.num_params(), res.world_size, latency_s=alpha, choices=hs,
                              wires=wires, overlap_steps=s.overlap_steps, egress=egress)
    chosen = {k: v for k, v in c.settings().items() if k in todo}
    kept = sorted(set(sync_rule.KEYS) & set(given))
    reason = c.reason + (f"; as set: {', '.join(kept)}" if kept else "")
    # What the ranks need to apply the rule again on the step time they measure (train/replan.py).
    measured = all(n.step_seconds for n in res.nodes)
    replan = ReplanInputs(step_seconds=step_s, step_source="measured" if measured else "FLOP/s x efficiency",
                          bandwidth_bytes_s=beta, latency_s=alpha, num_params=float(model.num_params()),
                          choices=list(hs), wires=list(wires), keys=sorted(chosen),
                          egress_quotas=[list(q) for q in egress.quotas] if egress else [],
                          run_steps=cfg.max_steps, run_seconds=cfg.time_budget_s or 0.0)
    return dataclasses.replace(s, name="diloco", compress="none", **chosen).with_launcher(
        planned=sorted(chosen), planned_reason=reason, replan=replan)


def choose_for_training(cfg: "TrainConfig", cluster: "Cluster | None", probe: dict | None,
                        given: set[str] | None = None) -> tuple["StrategyConfig", str]:
    """Used by `vpscluster train --strategy auto`: a concrete StrategyConfig and the reason.

    DDP's variants compete with DiLoCo as the sync rule sets it up (`plan_diloco`); `given`: the
    strategy keys the user set (None: those that differ from the defaults).
    """
    model, res, eff = plan_inputs(cfg, cluster, probe)
    tokens = cfg.max_steps * model.shape.batch_size * model.shape.seq_len * res.world_size
    s = cfg.strategy
    given = given_keys(s) if given is None else set(given)
    base = Settings.of(s, name="ddp", fragments=1)  # the user's knobs; the candidates vary name, compress, H, wire
    options = candidates(res.world_size, [], base=base)
    dl = None
    if res.world_size > 1:
        dl = plan_diloco(cfg, model, res, eff.value, given, strategy=dataclasses.replace(s, fragments=1))
        options.append(Settings.of(dl, name="diloco", compress="none", fragments=1))
    # The strategies that run on regions, where the cluster has them (`plan/hierarchical.py`).
    by_region = hierarchical.options_for_auto(cfg, model, res, eff.value, cluster, probe, given) if dl else {}
    options += [Settings.of(o) for o in by_region.values()]
    chosen, reason, _ = choose(model, res, tokens, eff.value, options)
    c = chosen.settings
    if c.name in by_region:
        out = by_region[c.name]
        reason = f"{reason}; {out.launcher.planned_reason}" if out.launcher.planned_reason else reason
        return out.with_launcher(planned_reason=reason), reason
    if dl is not None and c.name == dl.name:
        out = dataclasses.replace(dl, name="diloco", compress="none", fragments=1)
        if out.launcher.planned_reason:
            reason = f"{reason}; {out.launcher.planned_reason}"
            out = out.with_launcher(planned_reason=reason)
        return out, reason
    out = dataclasses.replace(s, name=c.name, compress=c.compress).with_launcher(planned=[], planned_reason=None,
                                                                                replan=None)
    if out.fragments > out.sync_every:
        out = dataclasses.replace(out, fragments=1)
    return out, reason
