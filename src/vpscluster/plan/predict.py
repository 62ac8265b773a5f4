"""One prediction: a strategy with its settings on given resources -> step time, traffic, memory.

A synchronous DDP step: every rank computes its batch; buckets of gradients are all-reduced on
the best ring while backward runs (`comm.ddp_exposed_seconds`); the step ends when the slowest
rank's last bucket is reduced. The slowest rank sets the pace; faster ranks wait (their
`wait_seconds`), which is what their measured communication time includes.

A DiLoCo round: H local steps without communication, then one blocking sync of the
pseudo-gradient (a token-count all-reduce, then the encoded pseudo-gradient reduce-scattered by
all_to_all and all-gathered, in fp32, bf16 or int8 with per-block scales). The mean step is the slowest rank's compute plus the sync over H.
Where the plan measured it (`plan.steptime`), a node's compute also carries its share of the
sync's own CPU work (encode, decode, sums, outer step: `NodeResources.sync_extra_s`) over H.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from vpscluster.plan import comm, compute, memory
from vpscluster.plan.resources import Resources
from vpscluster.plan.shapes import ModelSpec
from vpscluster.train.config import StrategyConfig
from vpscluster.train.strategies import costs_for
from vpscluster.train.strategies.costs import StrategyCosts
from vpscluster.train.strategies.diloco_costs import diloco_exposed_seconds  # noqa: F401 (the plan's name for it)

DAY_S = 86400.0


class Settings(StrategyConfig):
    """A strategy's settings as the planner sees them: StrategyConfig itself (the same fields,
    defaults and rules, never a copy), plus the planner's label, quality risk and JSON."""

    @classmethod
    def of(cls, config: StrategyConfig, **changes) -> "Settings":
        # field by field, not asdict: the nested records (`launcher`) stay records
        return cls(**{**{f.name: getattr(config, f.name) for f in dataclasses.fields(config)}, **changes})

    @property
    def costs(self) -> StrategyCosts:
        """The strategy's cost companion (`train/strategies/costs.py`)."""
        return costs_for(self.name)

    def label(self) -> str:
        return self.costs.label(self)

    def quality_risk(self, total_steps: int | None = None) -> float:
        """0 = the same updates as one big machine; larger = further from it (heuristic scale)."""
        return self.costs.quality_risk(self, total_steps)

    def to_dict(self) -> dict:
        return self.costs.describe(self)


def risk_label(risk: float) -> str:
    return "none" if risk == 0 else "low" if risk <= 1.5 else "medium" if risk <= 3 else "high"


@dataclass
class NodePrediction:
    name: str
    compute_seconds: float
    wait_seconds: float  # waiting for slower ranks (included in this rank's measured comm time)
    comm_seconds: float  # communication this rank measures per step: exposed comm + wait
    bytes_sent_per_step: float
    memory_bytes: float
    memory_available_bytes: float
    memory_kind: str
    fits: bool
    egress_bytes_per_day: float = 0.0
    egress_quota_bytes: float | None = None
    egress_quota_period_s: float | None = None
    egress_exceeded_after_s: float | None = None  # None: within quota (or no quota)


@dataclass
class Prediction:
    settings: Settings
    step_seconds: float
    compute_seconds: float  # the slowest rank's compute per step
    comm_seconds: float  # exposed communication per step (the step beyond the slowest compute)
    comm_busy_seconds: float  # time the network is busy per step (overlapped or not)
    tokens_per_step: int
    tokens_per_s: float
    compute_utilization: float  # compute / wall, mean over ranks
    steps: int
    time_to_train_seconds: float
    bytes_sent_per_step: float
    memory_bytes_per_node: float
    fits: bool
    quality_risk: float
    nodes: list[NodePrediction] = field(default_factory=list)
    memory_components: dict = field(default_factory=dict)

    @property
    def egress_bytes_per_node_per_day(self) -> float:
        return max((n.egress_bytes_per_day for n in self.nodes), default=0.0)

    @property
    def quota_exceeded(self) -> list[NodePrediction]:
        return [n for n in self.nodes if n.egress_exceeded_after_s is not None]

    def to_dict(self) -> dict:
        return {
            "strategy": self.settings.name, "settings": self.settings.to_dict(), "label": self.settings.label(),
            "step_seconds": self.step_seconds, "compute_seconds": self.compute_seconds,
            "comm_seconds": self.comm_seconds, "comm_busy_seconds": self.comm_busy_seconds,
            "tokens_per_step": self.tokens_per_step, "tokens_per_s": self.tokens_per_s,
            "compute_utilization": self.compute_utilization, "steps": self.steps,
            "time_to_train_seconds": self.time_to_train_seconds,
            "bytes_sent_per_step": self.bytes_sent_per_step,
            "egress_bytes_per_node_per_day": self.egress_bytes_per_node_per_day,
            "memory_bytes_per_node": int(self.memory_bytes_per_node), "fits": self.fits,
            "quality_risk": risk_label(self.quality_risk),
        }


def sync_traffic(settings: Settings, model: ModelSpec, world_size: int) -> list[tuple[str, float]]:
    """The collectives of one sync as (kind, buffer bytes): the strategy's companion says
    (`train/strategies/*_costs.py`)."""
    return settings.costs.sync_traffic(settings, model, world_size)


def bytes_sent(traffic: list[tuple[str, float]], world_size: int) -> float:
    n = world_size
    if n <= 1:
        return 0.0
    per = {"allreduce": 2 * (n - 1) / n, "alltoall": (n - 1) / n, "allgather": n - 1}
    return sum(per[kind] * b for kind, b in traffic)


def sync_seconds(traffic: list[tuple[str, float]], ring: comm.Ring, links, world_size: int) -> float:
    total = 0.0
    for kind, b in traffic:
        if kind == "allreduce":
            total += ring.allreduce_seconds(b, world_size)
        elif kind == "allgather":
            total += ring.allgather_seconds(b, world_size)
        else:
            total += comm.alltoall_seconds(links, b, world_size)
    return total


def ring_for(res: Resources) -> comm.Ring:
    """The best ring over the link matrix; its per-step latency from the probe's all-reduce sweep
    when there is one (a fit t = alpha + S/beta of the real collective: alpha spread over the
    2(n-1) steps of the ring), since software overhead dwarfs the wire's one-way delay on LANs."""
    ring = comm.best_ring(res.links)
    fit, n = res.collective_fit, res.world_size
    if fit and n > 1 and fit["alpha_s"] > 0:
        ring = dataclasses.replace(ring, alpha_s=max(ring.alpha_s, fit["alpha_s"] / (2 * (n - 1))))
    return ring


def predict(model: ModelSpec, res: Resources, settings: Settings, tokens: float, efficiency: float,
            ring: comm.Ring | None = None) -> Prediction:
    if settings.costs.by_region:  # priced on the regions (`plan/hierarchical.py`)
        from vpscluster.plan.hierarchical import predict_hierarchical

        return predict_hierarchical(model, res, settings, tokens, efficiency)
    n = res.world_size
    ring = ring or ring_for(res)
    costs = settings.costs
    computes = [compute.node_compute(model, node, efficiency) for node in res.nodes]
    if n > 1:  # a sync's own work, where measured, spread over its round
        computes = [compute.with_extra(c, costs.sync_compute_s(settings, node.sync_extra_s or {}))
                    for c, node in zip(computes, res.nodes)]
    slowest = max(computes, key=lambda c: c.seconds)
    traffic = sync_traffic(settings, model, n)
    sent = bytes_sent(traffic, n)
    if n <= 1:
        exposed = busy = 0.0
        sent = 0.0
    else:
        exposed, busy = costs.exposed_seconds(settings, _Network(ring, res.links, n, model, slowest))
        sent /= costs.steps_per_sync(settings)
    step = slowest.seconds + exposed
    tokens_per_step = compute.tokens_per_rank_step(model) * n
    steps = max(1, math.ceil(tokens / tokens_per_step))
    mixed = {node.name: res.mixed_on(node) for node in res.nodes}

    node_preds = []
    for node, c in zip(res.nodes, computes):
        est = memory.estimate(model, settings.name, n, mixed_precision=mixed[node.name], memory_kind=node.memory_kind,
                              compress=settings.compress, wire_dtype=settings.wire_dtype, fragments=settings.fragments)
        np_ = NodePrediction(
            name=node.name, compute_seconds=c.seconds, wait_seconds=slowest.seconds - c.seconds,
            comm_seconds=step - c.seconds if n > 1 else 0.0, bytes_sent_per_step=sent * node.ranks,
            memory_bytes=est.total_bytes, memory_available_bytes=node.memory_bytes, memory_kind=node.memory_kind,
            fits=est.total_bytes <= node.memory_bytes * memory.HEADROOM,
            egress_quota_bytes=node.egress_quota_bytes, egress_quota_period_s=node.egress_quota_period_s,
        )
        _egress(np_, step, steps * step)
        node_preds.append(np_)
    mem = max(node_preds, key=lambda p: p.memory_bytes)
    est0 = memory.estimate(model, settings.name, n, mixed_precision=mixed[mem.name], memory_kind=mem.memory_kind,
                           compress=settings.compress, wire_dtype=settings.wire_dtype, fragments=settings.fragments)
    return Prediction(
        settings=settings, step_seconds=step, compute_seconds=slowest.seconds, comm_seconds=exposed,
        comm_busy_seconds=busy, tokens_per_step=tokens_per_step, tokens_per_s=tokens_per_step / step,
        compute_utilization=sum(c.seconds for c in computes) / len(computes) / step, steps=steps,
        time_to_train_seconds=steps * step, bytes_sent_per_step=sent,
        memory_bytes_per_node=mem.memory_bytes, fits=all(p.fits for p in node_preds),
        quality_risk=settings.quality_risk(steps), nodes=node_preds,
        memory_components={k: int(v) for k, v in est0.components.items()},
    )


@dataclass
class _Network:
    """The network model a strategy's companion prices its syncs on (`costs.StepNetwork`)."""

    ring: comm.Ring
    links: object
    world_size: int
    model: ModelSpec
    slowest: compute.NodeCompute

    @property
    def alpha_s(self) -> float:
        return self.ring.alpha_s

    @property
    def compute_s(self) -> float:
        return self.slowest.seconds

    def collectives_seconds(self, traffic: list[tuple[str, float]]) -> float:
        return sync_seconds(traffic, self.ring, self.links, self.world_size)

    def overlapped_allreduce_seconds(self, grad_bytes_per_param: float, bucket_mb: float) -> tuple[float, float]:
        return comm.ddp_exposed_seconds(self.ring, self.world_size, self.model, grad_bytes_per_param, bucket_mb,
                                        self.slowest.forward_s, self.slowest.backward_s)


def _egress(node: NodePrediction, step_s: float, run_s: float) -> None:
    rate = node.bytes_sent_per_step / step_s if step_s > 0 else 0.0
    node.egress_bytes_per_day = rate * DAY_S
    quota, period = node.egress_quota_bytes, node.egress_quota_period_s
    if quota and period and rate > 0:
        # Within one quota period the run sends rate * min(run, period) bytes.
        if rate * min(run_s, period) > quota:
            node.egress_exceeded_after_s = quota / rate
