"""`make_plan`: model + resources -> the whole plan document (what `vpscluster plan --json` prints).

Stages: resolve the model (`shapes`), the machines (`resources`: probe, cluster file, flags,
stated assumptions), the compute efficiency (`calibrate`), predict every candidate strategy
(`predict`), pick one (`auto`, or the strategy asked for), then memory layouts that fit,
egress against quotas, and hardware guidance.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path

from vpscluster.errors import UserError
from vpscluster.plan import auto, comm, hierarchical, memory
from vpscluster.plan.compute import tokens_per_rank_step
from vpscluster.plan import steptime
from vpscluster.plan.calibrate import efficiency_for
from vpscluster.plan.guidance import guidance
from vpscluster.plan.predict import Prediction, Settings, predict, ring_for, risk_label
from vpscluster.plan.resources import gather_resources
from vpscluster.plan.shapes import load_model
from vpscluster.train.config import StrategyConfig
from vpscluster.train.strategies import AUTO, CHOICES, STRATEGIES, costs_for

CHINCHILLA_TOKENS_PER_PARAM = 20  # Hoffmann et al., 2022: compute-optimal tokens per parameter
_STRATEGY = StrategyConfig()  # the strategy knobs' defaults, read from the typed config


@dataclass
class PlanRequest:
    model: str
    tokens: float | None = None
    cluster: str | None = None
    probe: str | None = None
    strategy: str = AUTO
    batch_size: int | None = None
    seq_len: int | None = None
    nodes: int | None = None
    bandwidth_mbit: float | None = None
    rtt_ms: float | None = None
    flops: float | None = None
    flops_per_node: list[float] | None = None  # uneven nodes: GFLOP/s... as FLOP/s, one per node
    memory_bytes: float | None = None
    compress: str = _STRATEGY.compress
    powersgd_rank: int = _STRATEGY.powersgd_rank
    bucket_mb: float = _STRATEGY.bucket_mb
    # None: DiLoCo's H and wire come from the sync rule (train/strategies/sync_rule.py), as `train` picks them
    sync_every: int | None = None
    wire_dtype: str | None = None
    fragments: int = _STRATEGY.fragments
    calibrate: bool = False
    threads_per_rank: int | None = None  # torch threads per rank in training (default: the probe's)
    checkpoint_load_s: float = 60.0
    mixed_precision: bool = False  # plan bf16 mixed precision on GPU nodes (vpscluster trains fp32)


def load_probe_file(path: str) -> dict:
    try:
        doc = json.loads(Path(path).read_text())
    except OSError as e:
        raise UserError(f"--probe {path}: cannot read it ({e.strerror}); run `vpscluster probe --out {path}`") from None
    except ValueError:
        raise UserError(f"--probe {path}: not valid JSON; give the file `vpscluster probe --out` wrote") from None
    if not isinstance(doc, dict):
        raise UserError(f"--probe {path}: expected a JSON object with nodes and links")
    return doc


def make_plan(req: PlanRequest) -> dict:
    if req.strategy not in CHOICES:
        raise UserError(f"--strategy {req.strategy!r}: choose one of {', '.join(CHOICES)}")
    if req.tokens is not None and req.tokens <= 0:
        raise UserError(f"--tokens must be positive, got {req.tokens:g}")
    if req.checkpoint_load_s <= 0:
        raise UserError("--checkpoint-load-s must be positive")
    model = load_model(req.model, req.batch_size, req.seq_len)
    cluster = probe = None
    assumptions: list[str] = []
    if req.cluster:
        from vpscluster.cluster.inventory import load_cluster

        cluster = load_cluster(req.cluster)
    if req.probe:
        probe = load_probe_file(req.probe)
    elif cluster is not None:
        try:
            from vpscluster.probe.store import load_probe
        except ImportError:
            load_probe = None
        probe = load_probe(cluster) if load_probe else None
        if probe is None:
            assumptions.append("no probe of this cluster found; run `vpscluster probe --cluster FILE` for measured figures")
    res = gather_resources(cluster, probe, nodes=req.nodes, bandwidth_mbit=req.bandwidth_mbit, rtt_ms=req.rtt_ms,
                           flops=req.flops, memory_bytes=req.memory_bytes)
    res.mixed_precision = req.mixed_precision
    if req.flops_per_node is not None:
        if len(req.flops_per_node) != len(res.nodes):
            raise UserError(
                f"--flops gives {len(req.flops_per_node)} figures for {len(res.nodes)} node(s); give one, or one per node"
            )
        for node, f in zip(res.nodes, req.flops_per_node):
            node.flops = f
    step_cal = None
    if req.flops is None and req.flops_per_node is None:  # --flops plans hypothetical compute
        eff, step_cal = steptime.planned_efficiency(res, model, cluster, probe, threads=req.threads_per_rank,
                                                    calibrate=req.calibrate, probe_threads=_probe_threads(probe))
    else:
        threads = req.threads_per_rank or _probe_threads(probe)
        eff = efficiency_for(model, res, calibrate=req.calibrate, threads=threads, cluster=cluster,
                             matmul_threads=_probe_threads(probe))
    if step_cal:
        assumptions += step_cal["notes"]
    assumptions += res.assumptions
    if eff.source == "assumed":
        assumptions.append(eff.describe())
    tokens = req.tokens
    if tokens is None:
        tokens = CHINCHILLA_TOKENS_PER_PARAM * model.num_params()
        assumptions.append(f"tokens: {tokens:.3g} ({CHINCHILLA_TOKENS_PER_PARAM} per parameter, compute-optimal); set --tokens")

    rule = _sync_rule(req, model, res, eff.value, tokens)
    base = Settings(compress=req.compress, powersgd_rank=req.powersgd_rank, bucket_mb=req.bucket_mb,
                    sync_every=req.sync_every or (rule.sync_every if rule else _STRATEGY.sync_every),
                    wire_dtype=req.wire_dtype or (rule.wire_dtype if rule else _STRATEGY.wire_dtype),
                    fragments=req.fragments)
    _, _, preds = auto.choose(model, res, tokens, eff.value, auto.candidates(res.world_size, base=base))
    # What `train --strategy auto` weighs: DDP's variants against DiLoCo as the sync rule sets it up.
    options = auto.candidates(res.world_size, strategies=("ddp",), base=base)
    if rule is not None:
        options.append(dataclasses.replace(base, name="diloco", compress="none"))
    # With regions (labels.region, or the probe's): DiLoCo across them, DDP inside (`plan/hierarchical.py`).
    by_region = hierarchical.plan_options(model, res, eff.value, base, hierarchical.cluster_regions(cluster, probe),
                                          req.sync_every, req.wire_dtype,
                                          math.ceil(tokens / (tokens_per_rank_step(model) * res.world_size)))
    for option in by_region.values():
        options.append(option)
        preds.append(predict(model, res, option, tokens, eff.value))
    auto_pred, auto_reason, _ = auto.choose(model, res, tokens, eff.value, options)
    flat_rule = rule is not None and auto_pred.settings.costs.planned_keys and not auto_pred.settings.costs.by_region
    if flat_rule:  # and why this H and wire, as `train` says it
        auto_reason = f"{auto_reason}; {rule.reason}"
    if req.strategy == AUTO:
        chosen, reason = auto_pred, auto_reason
    else:
        asked = costs_for(req.strategy)
        settings = dataclasses.replace(base, name=req.strategy, compress=req.compress if asked.takes("compress") else "none")
        if asked.by_region:
            if req.strategy not in by_region:
                raise UserError(hierarchical.needs_regions(req.strategy))
            settings = by_region[req.strategy]
        chosen = predict(model, res, settings, tokens, eff.value)
        reason = f"as asked (--strategy {req.strategy}); auto would choose {auto_pred.settings.label()}"
        if rule is not None and asked.planned_keys and not asked.by_region and not (req.sync_every and req.wire_dtype):
            reason = f"as asked (--strategy {req.strategy}), {rule.reason}; auto would choose {auto_pred.settings.label()}"
        if chosen.time_to_train_seconds > auto_pred.time_to_train_seconds * 1.1:
            reason += f", {chosen.time_to_train_seconds / auto_pred.time_to_train_seconds:.1f}x faster to the token target"

    ring = ring_for(res)
    doc = chosen.to_dict()
    doc.update(
        reason=reason, tokens=tokens,
        model=model.to_dict() | {"batch_size": model.shape.batch_size},
        efficiency={"value": eff.value, "source": eff.source},
        world_size=res.world_size,
        nodes=[_node_doc(n, r) for n, r in zip(chosen.nodes, res.nodes)],
        ring=_ring_doc(ring, res),
        memory=_memory_doc(model, res, chosen),
        egress=_egress_doc(chosen),
        candidates=[_candidate_doc(p) for p in _representative(preds)],
        auto={"label": auto_pred.settings.label(), "reason": auto_reason},
        guidance=guidance(model, res, chosen.settings.name, eff.value, req.checkpoint_load_s),
        assumptions=assumptions,
        measured=res.measured,
        balance=balance_doc(chosen, res, model.shape.batch_size),
        step_calibration=step_cal,
    )
    worst = doc["ring"]["worst_order_weakest_link_mbit"]
    if worst is not None and doc["ring"]["weakest_link_mbit"] and worst < doc["ring"]["weakest_link_mbit"]:
        assumptions.append(
            f"ranks form the ring in the order shown; the launcher's rendezvous assigns ranks, and a bad order "
            f"would run the ring at {worst:g} Mbit/s instead of {doc['ring']['weakest_link_mbit']:g}")
    if res.collective_fit and res.world_size > 1:
        doc["collective_fit_check"] = _fit_check(model, res, ring)
    return doc


def _sync_rule(req: PlanRequest, model, res, efficiency: float, tokens: float):
    """The sync rule's DiLoCo H and wire for this plan (what `train --strategy diloco` would run),
    for a run of `tokens` (the egress quotas' share); a value the request sets is kept. None with
    one rank or without a usable link figure."""
    from vpscluster.train.strategies import sync_rule

    if res.world_size <= 1:
        return None
    choices = [req.sync_every] if req.sync_every else [h for h in sync_rule.SYNC_EVERY_CHOICES if h >= req.fragments]
    try:
        return auto.sync_choice(model, res, efficiency, choices or [req.fragments],
                                (req.wire_dtype,) if req.wire_dtype else sync_rule.WIRES,
                                run_steps=math.ceil(tokens / (tokens_per_rank_step(model) * res.world_size)))
    except ValueError:  # no bandwidth figure (an unmeasured, unadvertised link)
        return None


def balance_doc(chosen: Prediction, res, batch_size: int) -> dict | None:
    """Shares on uneven nodes (`train/shares.py`), the predicted step with them and without
    (even split: everyone waits for the slowest). Only the compute part changes.

    ddp: the global batch of world x batch_size sequences split by speed in whole sequences
    (`--batch-size 1 --micro-batches N --speeds ...`): the same gradient, the finest split.
    diloco: every micro-batch is an inner step of --batch-size sequences, so their size stays;
    the split is made finer with k x world micro-batches per step and a round of H/k steps (the
    same inner steps per round), k the smallest that divides H and brings the split within
    GAP_HINT of an exact one (bench uneven: 12 micro-batches at H = 10 reached 80% of an even
    spread, 24 at H = 5 92%)."""
    from vpscluster.train.shares import GAP_HINT, predicted_step, split, split_gap

    per_rank = [p.compute_seconds for p, r in zip(chosen.nodes, res.nodes) for _ in range(r.ranks)]
    if len(per_rank) < 2 or min(per_rank) <= 0:
        return None
    world, comm = len(per_rank), chosen.step_seconds - chosen.compute_seconds
    per_round = chosen.settings.costs.micro_batches_are_steps  # a micro-batch is an inner step of a round
    if per_round:
        H = chosen.settings.sync_every
        speeds = [1 / c for c in per_rank]  # inner steps (micro-batches) per second of each rank
        for k in [d for d in range(1, H + 1) if H % d == 0]:  # 1 always divides: k is set
            if split_gap(split(speeds, k * world, 1, _STRATEGY.max_spread), speeds, _STRATEGY.max_spread) <= GAP_HINT:
                break
        total = k * world
    else:
        k, total = 1, world * batch_size
        speeds = [batch_size / c for c in per_rank]  # sequences per second of each rank
    shares = split(speeds, total, min_share=1, max_spread=_STRATEGY.max_spread)
    # A step of k micro-batches per rank on average carries k steps' tokens and, with H/k steps a
    # round, k steps' share of the round's communication.
    even_step = max(per_rank) + comm
    balanced_step = predicted_step(shares, speeds) + k * comm
    even_tps, balanced_tps = chosen.tokens_per_step / even_step, k * chosen.tokens_per_step / balanced_step
    rel = [round(v / min(speeds), 3) for v in speeds]
    flags = (f"--micro-batches {total} --sync-every {H // k}" if per_round else f"--batch-size 1 --micro-batches {total}")
    rounds = {"round_seconds_even": even_step * H, "round_seconds_balanced": balanced_step * (H // k)} if per_round else {}
    return {
        **rounds,  # diloco: a step of the balanced split is k steps' work, so compare rounds
        "shares": shares,
        "unit": "micro-batches of --batch-size sequences (inner steps)" if per_round else "sequences of the global batch",
        "global_batch": total,
        "speeds": rel,
        "even_step_seconds": even_step,
        "balanced_step_seconds": balanced_step,
        "speedup": balanced_tps / even_tps,
        # whole units: how much longer the compute takes than an exact split would
        "split_gap": split_gap(shares, speeds, _STRATEGY.max_spread),
        "tokens_per_s_even": even_tps,
        "tokens_per_s_balanced": balanced_tps,
        "train_flags": f"{flags} --speeds {','.join(f'{v:g}' for v in rel)} --balance",
    }


def _probe_threads(probe: dict | None) -> int | None:
    for n in (probe or {}).get("nodes", []) or []:
        if isinstance(n, dict) and isinstance(n.get("torch_threads"), int):
            return n["torch_threads"]
    return None


def _node_doc(p, r) -> dict:
    return {
        "name": p.name, "flops": r.flops, "ranks": r.ranks, "compute_seconds": p.compute_seconds,
        "wait_seconds": p.wait_seconds, "comm_seconds": p.comm_seconds, "bytes_sent_per_step": p.bytes_sent_per_step,
        "memory_bytes": int(p.memory_bytes), "memory_available_bytes": int(p.memory_available_bytes),
        "memory_kind": p.memory_kind, "fits": p.fits, "egress_bytes_per_day": p.egress_bytes_per_day,
        "egress_quota_bytes": p.egress_quota_bytes, "egress_quota_period_s": p.egress_quota_period_s,
        "egress_exceeded_after_s": p.egress_exceeded_after_s, "disk_read_mb_s": r.disk_read_mb_s,
    }


def _ring_doc(ring: comm.Ring, res) -> dict:
    n = len(res.nodes)
    worst = None
    if 2 < n <= comm.EXACT_RING_MAX_NODES:
        import itertools

        worst = min(min(res.links.bandwidth_mbit[i][j] for i, j in comm.ring_links((0, *rest)))
                    for rest in itertools.permutations(range(1, n)))
    return {"order": [res.nodes[i].name for i in ring.order],
            "weakest_link_mbit": None if math.isinf(ring.weakest_mbit) else ring.weakest_mbit,
            "worst_order_weakest_link_mbit": worst, "alpha_s": ring.alpha_s}


def _memory_doc(model, res, chosen: Prediction) -> dict:
    """Per-rank memory for each strategy and layout, and the least intrusive one that fits everywhere."""
    s = chosen.settings
    kw = dict(compress=s.compress, wire_dtype=s.wire_dtype, fragments=s.fragments)
    options = []
    for strategy in STRATEGIES:
        for opt in memory.candidate_options(model, strategy, res.world_size):
            fits_all, need = True, 0.0
            for node in res.nodes:
                est = memory.estimate(model, strategy, res.world_size, mixed_precision=res.mixed_on(node),
                                      memory_kind=node.memory_kind, option=opt,
                                      **(kw if strategy == s.name else {}))
                need = max(need, est.total_bytes)
                fits_all &= est.total_bytes <= node.memory_bytes * memory.HEADROOM
            options.append({"strategy": strategy, "sharding": opt.sharding, "checkpointing": opt.checkpointing,
                            "micro_batch": opt.micro_batch or model.shape.batch_size, "layout": opt.describe(),
                            "memory_bytes_per_node": int(need), "fits": fits_all})
    out = {"components": chosen.memory_components, "options": options}
    if not chosen.fits:
        fix = next((o for o in options if o["strategy"] == s.name and o["fits"]), None)
        if fix is None:
            fix = next((o for o in options if o["fits"]), None)
        out["fix"] = (f"{fix['strategy']} with {fix['layout']} ({fix['memory_bytes_per_node'] / 2**30:.1f} GiB per node)"
                      if fix else "no layout fits; add memory or nodes (see guidance.least_memory_bytes_per_node)")
        if fix and fix["sharding"] != "none":
            out["fix"] += "; sharding is not built into vpscluster's trainer yet"
    return out


def _egress_doc(pred: Prediction) -> dict:
    warnings = []
    for n in pred.quota_exceeded:
        days = n.egress_exceeded_after_s / 86400
        warnings.append(
            f"{n.name}: sends {n.egress_bytes_per_day / 1e9:.1f} GB/day; its quota of {n.egress_quota_bytes / 1e12:g} TB per "
            f"{n.egress_quota_period_s / 86400:g} days is used up after {days:.1f} days "
            f"(the run takes {pred.time_to_train_seconds / 86400:.1f} days)")
    return {"quota_exceeded": bool(warnings), "warnings": warnings}


def _candidate_doc(p: Prediction) -> dict:
    d = p.to_dict()
    return {k: d[k] for k in ("label", "strategy", "settings", "step_seconds", "compute_seconds", "comm_seconds",
                              "tokens_per_s", "compute_utilization", "time_to_train_seconds",
                              "egress_bytes_per_node_per_day", "memory_bytes_per_node", "fits", "quality_risk")}


def _representative(preds: list[Prediction]) -> list[Prediction]:
    """Every DDP variant and, per DiLoCo wire dtype, a spread of H (the table stays readable)."""
    keep = [p for p in preds if p.settings.costs.representative(p.settings)]
    return sorted(keep, key=lambda p: p.time_to_train_seconds)


def _fit_check(model, res, ring) -> dict:
    """Cross-check: the probe's fitted all-reduce time for the gradients vs the link-matrix model."""
    fit = res.collective_fit
    nbytes = model.num_params() * 4.0
    return {"gradient_allreduce_seconds_from_fit": fit["alpha_s"] + nbytes / fit["beta_bytes_s"],
            "gradient_allreduce_seconds_from_links": ring.allreduce_seconds(nbytes, res.world_size)}


__all__ = ["PlanRequest", "make_plan", "risk_label"]
