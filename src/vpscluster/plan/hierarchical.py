"""The plan of a strategy that runs on regions (its cost companion's `by_region`, e.g.
`hierarchical`, `train/strategies/hierarchical.py`): its cost and its settings.

Cost of one step, on the regions of the cluster (`probe/regions.py`: the cluster file's
labels.region, else the groups the probe's link matrix shows):

    step = max over regions (its slowest compute + DDP's exposed all-reduce on the region's own
           ring, at the fast rate inside it)
         + one DiLoCo sync among the regions' leaders (a ring of R ranks over the slow links) / H

Both parts are the existing models on a part of the cluster, not new formulas: `predict` of ddp
on each region's nodes and links, `predict` of blocking DiLoCo (τ = 0, as the strategy syncs)
on the leaders' nodes and links. H and the wire come from the sync rule (`train/strategies/sync_rule.py`)
applied to the leaders: DiLoCo with R replicas over the slow links (`plan_diloco` on them).

Quality risk: the companion's `risk_on_regions` (`train/strategies/hierarchical_costs.py`: DiLoCo's
at the same H and wire, less where the regions are fewer than the ranks).

Here rather than in the companion because it needs the planner's link model on parts of the cluster.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING

from vpscluster.errors import UserError
from vpscluster.plan import compute, memory
from vpscluster.plan.resources import LinkMatrix, Resources
from vpscluster.train.strategies import STRATEGIES, costs_for

if TYPE_CHECKING:
    from vpscluster.cluster.node import Cluster
    from vpscluster.plan.predict import Prediction, Settings
    from vpscluster.plan.shapes import ModelSpec
    from vpscluster.train.config import StrategyConfig, TrainConfig



def region_strategies() -> list[str]:
    """The registered strategies that run on regions (`StrategyCosts.by_region`)."""
    return [name for name in STRATEGIES if costs_for(name).by_region]


def needs_regions(name: str) -> str:
    return (f"--strategy {name} needs at least two regions: give every node a labels.region in the cluster file, "
            "or run `vpscluster probe` (it finds regions from the links)")


# -- regions ----------------------------------------------------------------------------------


def cluster_regions(cluster: "Cluster | None", probe: dict | None) -> dict[str, str] | None:
    """{node: region} from the cluster file's labels.region when every node has one, else from
    the probe's regions when they cover every node; None otherwise (or with fewer than 2)."""
    if cluster is None:
        return None
    names = [n.name for n in cluster.nodes]
    labels = {n.name: (n.labels or {}).get("region") for n in cluster.nodes}
    if all(labels.values()):
        found = {n: str(r) for n, r in labels.items()}
    else:
        from vpscluster.probe.regions import region_of

        found = region_of(probe or {})
        if any(n not in found for n in names):
            return None
        found = {n: found[n] for n in names}
    return found if len(set(found.values())) > 1 else None


def region_indices(res: Resources, node_regions: dict[str, str]) -> list[list[int]]:
    """Indices of `res.nodes` per region, regions in the order of their first node."""
    out: dict[str, list[int]] = {}
    for i, node in enumerate(res.nodes):
        if node.name not in node_regions:
            raise UserError(f"node {node.name} has no region; give every node a labels.region in the cluster file "
                            "or run `vpscluster probe` again")
        out.setdefault(node_regions[node.name], []).append(i)
    return list(out.values())


def _subset(res: Resources, idx: list[int], one_rank: bool = False) -> Resources:
    """The nodes `idx` of `res` and the links among them (`one_rank`: one rank per node, a leader)."""
    nodes = [dataclasses.replace(res.nodes[i], ranks=1) if one_rank else res.nodes[i] for i in idx]
    links = LinkMatrix([res.links.names[i] for i in idx],
                       [[res.links.bandwidth_mbit[i][j] for j in idx] for i in idx],
                       [[res.links.rtt_ms[i][j] for j in idx] for i in idx])
    return Resources(nodes, links, measured=res.measured, mixed_precision=res.mixed_precision)


# -- cost -------------------------------------------------------------------------------------


def predict_hierarchical(model: "ModelSpec", res: Resources, settings: "Settings", tokens: float,
                         efficiency: float) -> "Prediction":
    """The prediction of `settings` (a strategy `by_region`, `launcher.node_regions` set) on `res`."""
    from vpscluster.plan.predict import NodePrediction, Prediction, _egress, predict

    costs = settings.costs
    inner, outer = costs.by_region
    regions = region_indices(res, settings.launcher.node_regions or {})
    if len(regions) < 2:  # one region: the strategy runs the inner one
        p = predict(model, res, dataclasses.replace(settings, name=inner), tokens, efficiency)
        return dataclasses.replace(p, settings=settings)
    inside = [predict(model, _subset(res, r), dataclasses.replace(settings, name=inner), tokens, efficiency)
              for r in regions]
    leaders = _subset(res, [r[0] for r in regions], one_rank=True)
    across = predict(model, leaders, dataclasses.replace(settings, name=outer, overlap_steps=0, fragments=1),
                     tokens, efficiency)
    compute_s = max(p.compute_seconds for p in inside)
    step = max(p.step_seconds for p in inside) + across.comm_seconds
    tokens_per_step = compute.tokens_per_rank_step(model) * res.world_size
    steps = max(1, math.ceil(tokens / tokens_per_step))
    n_regions, world = len(regions), res.world_size
    nodes, components = [], {}
    leader_nodes = {r[0] for r in regions}
    for region, p in zip(regions, inside):
        for i, n in zip(region, p.nodes):
            node = res.nodes[i]
            est = memory.estimate(model, inner, sum(res.nodes[j].ranks for j in region),
                                  mixed_precision=res.mixed_on(node), memory_kind=node.memory_kind,
                                  compress=settings.compress)
            across_mem = memory.estimate(model, outer, n_regions, mixed_precision=res.mixed_on(node),
                                    memory_kind=node.memory_kind, wire_dtype=settings.wire_dtype)
            extra = {k: v for k, v in across_mem.components.items() if k not in est.components}
            total = est.total_bytes + sum(extra.values())
            components = max(components, {**est.components, **extra}, key=lambda c: sum(c.values()))
            sent = n.bytes_sent_per_step + (across.bytes_sent_per_step if i in leader_nodes else 0.0)
            np_ = NodePrediction(
                name=n.name, compute_seconds=n.compute_seconds, wait_seconds=compute_s - n.compute_seconds,
                comm_seconds=step - n.compute_seconds, bytes_sent_per_step=sent, memory_bytes=total,
                memory_available_bytes=node.memory_bytes, memory_kind=node.memory_kind,
                fits=total <= node.memory_bytes * memory.HEADROOM,
                egress_quota_bytes=node.egress_quota_bytes, egress_quota_period_s=node.egress_quota_period_s)
            _egress(np_, step, steps * step)
            nodes.append(np_)
    risk = costs.risk_on_regions(settings, steps, n_regions, world)
    return Prediction(
        settings=settings, step_seconds=step, compute_seconds=compute_s, comm_seconds=step - compute_s,
        comm_busy_seconds=max(p.comm_busy_seconds for p in inside) + across.comm_busy_seconds,
        tokens_per_step=tokens_per_step, tokens_per_s=tokens_per_step / step,
        compute_utilization=sum(n.compute_seconds for n in nodes) / len(nodes) / step, steps=steps,
        time_to_train_seconds=steps * step,
        bytes_sent_per_step=sum(n.bytes_sent_per_step for n in nodes) / world,
        memory_bytes_per_node=max(n.memory_bytes for n in nodes), fits=all(n.fits for n in nodes),
        quality_risk=risk, nodes=nodes, memory_components={k: int(v) for k, v in components.items()})


# -- settings ---------------------------------------------------------------------------------


def plan_settings(cfg: "TrainConfig", model: "ModelSpec", res: Resources, efficiency: float,
                  node_regions: dict[str, str], given: set[str] | frozenset[str] = frozenset(),
                  strategy: "StrategyConfig | None" = None, name: str | None = None) -> "StrategyConfig":
    """cfg.strategy as strategy `name` (one `by_region`; default: its own name) on `node_regions`,
    H and wire (and the outer optimizer) from the sync rule on the regions' leaders for every one
    of those keys not in `given`. Blocking outer syncs, one fragment; no re-planning mid-run
    (`train/replan.py` plans flat DiLoCo)."""
    from vpscluster.plan.auto import plan_diloco

    s = strategy or cfg.strategy
    s = dataclasses.replace(s, name=name or s.name, overlap_steps=0, fragments=1).with_launcher(node_regions=node_regions)
    regions = region_indices(res, node_regions)
    if len(regions) < 2:
        inner = costs_for(s.name).by_region[0]
        return s.with_launcher(planned=[], planned_reason=f"one region: {inner} inside it", replan=None)
    leaders = _subset(res, [r[0] for r in regions], one_rank=True)
    planned = plan_diloco(cfg, model, leaders, efficiency, given, strategy=s)
    reason = planned.launcher.planned_reason and f"{len(regions)} regions: {planned.launcher.planned_reason}"
    return dataclasses.replace(planned, name=s.name, compress=s.compress).with_launcher(planned_reason=reason, replan=None)


def plan_for_training(cfg: "TrainConfig", cluster: "Cluster | None", given: set[str] | None = None
                      ) -> "StrategyConfig":
    """`train --strategy hierarchical` (a strategy `by_region`): the regions (the cluster file's
    labels, else the last probe's) and the settings. `strategy.regions` (per rank, e.g. a local
    run) is taken as it is."""
    from vpscluster.plan.auto import given_keys, plan_inputs

    s = cfg.strategy
    if s.regions is not None:
        return s
    probe = saved_probe(cluster)
    regions = s.launcher.node_regions or cluster_regions(cluster, probe)
    if not regions:
        raise UserError(needs_regions(s.name))
    model, res, eff = plan_inputs(cfg, cluster, probe)
    return plan_settings(cfg, model, res, eff.value, regions, given_keys(s) if given is None else given)


def options_for_auto(cfg: "TrainConfig", model: "ModelSpec", res: Resources, efficiency: float,
                     cluster: "Cluster | None", probe: dict | None, given: set[str]) -> dict[str, "StrategyConfig"]:
    """The candidates `train --strategy auto` weighs among the strategies `by_region`, by name;
    none without regions (`probe`: the plan's; None: the cluster's last saved one)."""
    names = [n for n in region_strategies() if costs_for(n).uneven_shares or not cfg.strategy.micro_batches]
    if not names:
        return {}
    regions = cfg.strategy.launcher.node_regions or cluster_regions(cluster, probe if probe is not None else saved_probe(cluster))
    if not regions or len(set(regions.values())) < 2:
        return {}
    return {name: plan_settings(cfg, model, res, efficiency, regions, given, name=name) for name in names}


def plan_options(model: "ModelSpec", res: Resources, efficiency: float, base: "Settings",
                 node_regions: dict[str, str] | None, sync_every: int | None, wire_dtype: str | None,
                 run_steps: int) -> dict[str, "Settings"]:
    """`vpscluster plan`'s candidates among the strategies `by_region`, by name: H and wire from
    the sync rule on the leaders (a value the request sets is kept); none without two regions."""
    from vpscluster.plan.auto import sync_choice
    from vpscluster.train.strategies import sync_rule

    if not node_regions or len(set(node_regions.values())) < 2:
        return {}
    regions = region_indices(res, node_regions)
    leaders = _subset(res, [r[0] for r in regions], one_rank=True)
    try:
        rule = sync_choice(model, leaders, efficiency, [sync_every] if sync_every else list(sync_rule.SYNC_EVERY_CHOICES),
                           (wire_dtype,) if wire_dtype else sync_rule.WIRES, overlap_steps=0, run_steps=run_steps)
    except ValueError:  # no bandwidth figure between the leaders
        return {}
    return {name: dataclasses.replace(base, name=name, compress="none", sync_every=rule.sync_every,
                                      wire_dtype=rule.wire_dtype, fragments=1, overlap_steps=0,
                                      ).with_launcher(node_regions=node_regions)
            for name in region_strategies()}


def saved_probe(cluster: "Cluster | None") -> dict | None:
    """The cluster's last probe (`vpscluster probe`), or None."""
    if cluster is None:
        return None
    from vpscluster.probe.store import load_probe

    return load_probe(cluster)
