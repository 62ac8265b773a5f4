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
from vpscluster.train.strategies import sparse_wire

INT8_BLOCK = 1024  # elements per fp32 absmax scale when DiLoCo sends int8 (train/strategies/wire.py)
DAY_S = 86400.0


class Settings(StrategyConfig):
    """A strategy's settings as the planner sees them: StrategyConfig itself (the same fields,
    defaults and rules, never a copy), plus the planner's label, quality risk and JSON."""

    @classmethod
    def of(cls, config: StrategyConfig, **changes) -> "Settings":
        return cls(**{**dataclasses.asdict(config), **changes})

    def label(self) -> str:
        if self.name == "ddp":
            return "ddp" if self.compress == "none" else f"ddp+{self.compress}" + (
                f" r={self.powersgd_rank}" if self.compress == "powersgd" else "")
        frag = f" F={self.fragments}" if self.fragments > 1 else ""
        return f"{self.name} H={self.sync_every} {self.wire_dtype}{frag}"

    def quality_risk(self, total_steps: int | None = None) -> float:
        """0 = the same updates as one big machine; larger = further from it (heuristic scale)."""
        if self.name == "ddp":
            return {"none": 0.0, "bf16": 0.5, "powersgd": 3.0}.get(self.compress, 3.0)
        risk = 1.0 + (self.sync_every > 50) + (self.sync_every > 100) + (self.sync_every > 250)
        # sparse: error feedback, but not yet measured here on long runs (issue 36 item 2)
        risk += {"fp32": 0.0, "bf16": 0.25, "int8": 0.5, "sparse4": 1.0, "sparse2": 1.0}[self.wire_dtype]
        if total_steps is not None and total_steps / self.sync_every < 20:
            risk += 2.0  # too few outer steps for the outer optimizer to do its work
        return risk

    def to_dict(self) -> dict:
        d = {"name": self.name}
        if self.name == "ddp":
            d.update(compress=self.compress, bucket_mb=self.bucket_mb)
            if self.compress == "powersgd":
                d["powersgd_rank"] = self.powersgd_rank
        else:
            d.update(sync_every=self.sync_every, wire_dtype=self.wire_dtype, fragments=self.fragments,
                     overlap_steps=self.overlap_steps)
        return d


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
    """The collectives of one sync as (kind, buffer bytes).

    ddp: one all-reduce of the gradients (fp32, bf16, or PowerSGD's factors).
    diloco (`train/strategies/wire.py`): a token-count all-reduce, then the encoded pseudo-gradient
    reduce-scattered by `all_to_all` and the reduced chunks all-gathered (each phase sends
    (n-1)/n of the encoded buffer per rank).
    """
    p = model.num_params()
    if settings.name == "ddp":
        if settings.compress == "powersgd":
            total, _ = comm.powersgd_allreduce_bytes(model, settings.powersgd_rank)
            return [("allreduce", total)]
        return [("allreduce", p * (2.0 if settings.compress == "bf16" else 4.0))]
    if settings.wire_dtype in sparse_wire.SPARSE_WIRES:  # every rank's buffer all-gathered, tokens inside
        return [("allgather", float(sparse_wire.sparse_nbytes(p, sparse_wire.SPARSE_WIRES[settings.wire_dtype])))]
    unit = world_size * (INT8_BLOCK if settings.wire_dtype == "int8" else 1)
    padded = math.ceil(p / unit) * unit
    encoded = {"fp32": 4.0 * padded, "bf16": 2.0 * padded, "int8": padded + 4.0 * padded / INT8_BLOCK}[settings.wire_dtype]
    return [("allreduce", 8.0), ("alltoall", encoded), ("allgather", encoded / max(1, world_size))]


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
    if settings.name == "hierarchical":  # its own cost model, on the regions (`plan/hierarchical.py`)
        from vpscluster.plan.hierarchical import predict_hierarchical

        return predict_hierarchical(model, res, settings, tokens, efficiency)
    n = res.world_size
    ring = ring or ring_for(res)
    computes = [compute.node_compute(model, node, efficiency) for node in res.nodes]
    if settings.name == "diloco" and n > 1:  # a sync's own work, where measured, spread over its round
        computes = [compute.with_extra(c, (node.sync_extra_s or {}).get(settings.wire_dtype, 0.0) / settings.sync_every)
                    for c, node in zip(computes, res.nodes)]
    slowest = max(computes, key=lambda c: c.seconds)
    traffic = sync_traffic(settings, model, n)
    sent = bytes_sent(traffic, n)
    if n <= 1:
        exposed = busy = 0.0
        sent = 0.0
    elif settings.name == "ddp":
        if settings.compress == "powersgd":
            # The PowerSGD hook compresses bucket by bucket too, but its P and Q all-reduces are
            # serialised behind the orthogonalisation; treat it as one exposed sync per step.
            busy = sync_seconds(traffic, ring, res.links, n) + 2 * comm.powersgd_allreduce_bytes(model, settings.powersgd_rank)[1] * ring.alpha_s
            exposed = busy
        else:
            per_param = 2.0 if settings.compress == "bf16" else 4.0
            exposed, busy = comm.ddp_exposed_seconds(ring, n, model, per_param, settings.bucket_mb,
                                                     slowest.forward_s, slowest.backward_s)
    else:
        exposed, busy = diloco_exposed_seconds(sync_seconds(traffic, ring, res.links, n), ring.alpha_s, n,
                                               settings.sync_every, settings.fragments,
                                               settings.overlap_steps, slowest.seconds)
        sent /= settings.sync_every
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


def diloco_exposed_seconds(round_s: float, alpha_s: float, n: int, sync_every: int, fragments: int,
                           overlap_steps: int, compute_s: float) -> tuple[float, float]:
    """(exposed, busy) seconds per inner step of DiLoCo's outer syncs.

    `round_s`: one whole-model sync. F fragments send the same bytes in F syncs per H steps, with
    F-1 more rounds of latency (3 collectives each). Blocking (τ = 0), every second is exposed.
    Overlapped (τ steps, `train/strategies/diloco.py`), a fragment's sync runs on one background
    thread behind τ steps of compute (τ at most H - 1, as the strategy clamps it): what outlasts
    them is exposed (the step that applies it waits); and with several fragments in flight the one
    thread serialises them, so no step is shorter than the thread's share of the network time."""
    total = round_s + (fragments - 1) * 3 * (n - 1) * alpha_s
    busy = total / sync_every
    tau = min(overlap_steps, sync_every - 1)
    if tau <= 0:
        return busy, busy
    late = fragments * max(0.0, total / fragments - tau * compute_s) / sync_every
    return max(late, busy - compute_s), busy


def _egress(node: NodePrediction, step_s: float, run_s: float) -> None:
    rate = node.bytes_sent_per_step / step_s if step_s > 0 else 0.0
    node.egress_bytes_per_day = rate * DAY_S
    quota, period = node.egress_quota_bytes, node.egress_quota_period_s
    if quota and period and rate > 0:
        # Within one quota period the run sends rate * min(run, period) bytes.
        if rate * min(run_s, period) > quota:
            node.egress_exceeded_after_s = quota / rate
