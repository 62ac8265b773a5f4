"""Hardware guidance computed from the same models: memory, link rate, disk speed.

- The least memory per node with which the model trains at all (the cheapest layout from
  `memory.candidate_options`), and the memory it needs as configured.
- The link rate at which plain DDP would reach 90% compute utilization on these nodes (found
  by bisection over a uniform link with the measured round-trip time), or why it cannot (the
  latency alone already costs more than 10% of a step).
- The disk read speed needed to load a checkpoint (fp32 weights and Adam moments, plus DiLoCo's
  global copy and outer momentum) within a target time, against each node's measured speed.
"""

from __future__ import annotations

import statistics

from vpscluster.plan import memory
from vpscluster.plan.predict import Settings, predict
from vpscluster.plan.resources import LinkMatrix, Resources
from vpscluster.plan.shapes import ModelSpec
from vpscluster.train.strategies import costs_for

TARGET_UTILIZATION = 0.9


def ddp_link_rate_for(model: ModelSpec, res: Resources, efficiency: float, target: float = TARGET_UTILIZATION,
                      settings: Settings = Settings()) -> float | None:
    """Mbit/s on every link for DDP to reach `target` utilization; None if no rate suffices."""
    if res.world_size <= 1:
        return 0.0
    rtts = [res.links.rtt_ms[i][j] for i in range(len(res.nodes)) for j in range(len(res.nodes)) if i != j]
    rtt = statistics.median(rtts) if rtts else 0.0
    names = res.links.names

    def utilization(mbit: float) -> float:
        r = Resources(res.nodes, LinkMatrix.uniform(names, mbit, rtt), None, [], res.measured)
        return predict(model, r, settings, 1, efficiency).compute_utilization

    lo, hi = 1.0, 1e7  # 1 Mbit/s .. 10 Tbit/s
    if utilization(hi) < target:
        return None
    if utilization(lo) >= target:
        return lo
    for _ in range(60):
        mid = (lo * hi) ** 0.5
        if utilization(mid) >= target:
            hi = mid
        else:
            lo = mid
        if hi / lo < 1.01:
            break
    return hi


def checkpoint_bytes(model: ModelSpec, strategy: str) -> float:
    """What one rank reads to resume: fp32 weights + two Adam moments + the strategy's own state
    (DiLoCo: global weights and outer momentum)."""
    p = model.num_params()
    return p * (12.0 + costs_for(strategy).state_bytes_per_param)


def guidance(model: ModelSpec, res: Resources, strategy: str, efficiency: float, load_within_s: float) -> dict:
    kind = "gpu" if any(n.memory_kind == "gpu" for n in res.nodes) else "ram"
    mixed = res.mixed_precision and kind == "gpu"
    least, how = memory.least_memory_bytes(model, strategy, res.world_size, mixed_precision=mixed, memory_kind=kind)
    as_configured = memory.estimate(model, strategy, res.world_size, mixed_precision=mixed,
                                    memory_kind=kind).total_bytes / memory.HEADROOM
    rate = ddp_link_rate_for(model, res, efficiency)
    ckpt = checkpoint_bytes(model, strategy)
    disks = [n.disk_read_mb_s for n in res.nodes if n.disk_read_mb_s]
    slowest_disk = min(disks) if disks else None
    out = {
        "memory_kind": kind,
        "least_memory_bytes_per_node": int(least),
        "least_memory_layout": how.describe(),
        "memory_bytes_per_node_as_configured": int(as_configured),
        "ddp_link_mbit_for_90pct_utilization": rate,
        "checkpoint_bytes": int(ckpt),
        "checkpoint_load_within_s": load_within_s,
        "disk_read_mb_s_needed": ckpt / load_within_s / 1e6,
        "slowest_disk_read_mb_s": slowest_disk,
        "checkpoint_load_seconds_on_slowest_disk": ckpt / (slowest_disk * 1e6) if slowest_disk else None,
    }
    if rate is None:
        out["ddp_link_note"] = ("no link rate suffices: per-message latency alone exceeds 10% of a step; "
                                "use diloco or a larger batch")
    return out
