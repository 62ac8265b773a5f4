"""What the plan knows about the machines: per-node compute and memory, the link matrix.

Built from the probe JSON (measured), the cluster file (advertised bandwidth, egress quotas) and
flags, in that order of trust. Every number that is not measured is recorded in `assumptions`
with what to run to measure it, so a plan without a probe says exactly what it guessed.

Probe keys read (all optional): nodes[].{name, cpu_count, memory_bytes, gpus[{memory_bytes,
flops?}], disk_read_mb_s, flops, flops_device}; links[].{src, dst, bandwidth_mbit, rtt_ms};
collectives[] / collective_fit with a fitted alpha (s) and beta (bytes/s).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any

from vpscluster.errors import UserError

# Assumed figures when nothing better is known; each use is stated in the plan's assumptions.
ASSUMED_CPU_FLOPS = 50e9  # fp32 matmul FLOP/s of a VPS with a few cores
ASSUMED_MEMORY_BYTES = 16 * 2**30
ASSUMED_BANDWIDTH_MBIT = 1000.0
ASSUMED_RTT_MS = 20.0
LOOPBACK_BANDWIDTH_MBIT = 20000.0  # local worker processes talk over loopback
LOOPBACK_RTT_MS = 0.05


@dataclass
class NodeResources:
    """One node as the plan sees it (one rank per node on CPU, one per GPU)."""

    name: str
    flops: float  # FLOP/s of one rank on this node (probe: measured matmul, quota included)
    memory_bytes: float  # memory one rank may use: RAM (shared by the node's ranks) or one GPU
    memory_kind: str = "ram"  # "ram" | "gpu"
    ranks: int = 1
    disk_read_mb_s: float | None = None
    egress_quota_bytes: float | None = None
    egress_quota_period_s: float | None = None
    # Measured compute seconds of one rank's step on this node (`plan.steptime`), for
    # `step_tokens` tokens; when set it replaces flops x efficiency in the compute model.
    step_seconds: float | None = None
    step_tokens: int = 0
    # Measured seconds one whole-model DiLoCo outer sync adds to a round here, per wire dtype
    # (its own encode/decode/outer step sharing the node's CPU with the steps; `plan.steptime`).
    sync_extra_s: dict[str, float] | None = None


@dataclass
class LinkMatrix:
    """Directed bandwidth and round-trip time between the nodes, by index."""

    names: list[str]
    bandwidth_mbit: list[list[float]]  # [src][dst]; the diagonal is unused
    rtt_ms: list[list[float]]

    @classmethod
    def uniform(cls, names: list[str], bandwidth_mbit: float, rtt_ms: float) -> "LinkMatrix":
        n = len(names)
        return cls(list(names), [[bandwidth_mbit] * n for _ in range(n)], [[rtt_ms] * n for _ in range(n)])

    def scaled(self, factor: float) -> "LinkMatrix":
        """The same links with every bandwidth multiplied by `factor` (for what-if guidance)."""
        return LinkMatrix(self.names, [[b * factor for b in row] for row in self.bandwidth_mbit], self.rtt_ms)


@dataclass
class Resources:
    nodes: list[NodeResources]
    links: LinkMatrix
    collective_fit: dict[str, float] | None = None  # {"world_size", "alpha_s", "beta_bytes_s"}
    assumptions: list[str] = field(default_factory=list)
    measured: bool = False  # a probe was used
    # vpscluster's trainer keeps everything in fp32; True plans bf16 mixed precision on GPUs.
    mixed_precision: bool = False

    def mixed_on(self, node: NodeResources) -> bool:
        return self.mixed_precision and node.memory_kind == "gpu"

    @property
    def world_size(self) -> int:
        return sum(n.ranks for n in self.nodes)


def gather_resources(
    cluster: Any | None = None,
    probe: dict | None = None,
    nodes: int | None = None,
    bandwidth_mbit: float | None = None,
    rtt_ms: float | None = None,
    flops: float | None = None,
    memory_bytes: float | None = None,
    local: bool | None = None,
) -> Resources:
    """Resolve per-node figures: flags override the probe, the probe overrides assumptions.

    `cluster` is a `cluster.node.Cluster` (or None); without one, `nodes` hypothetical or local
    nodes are planned (`local=True`: worker processes sharing this machine over loopback).
    """
    assumptions: list[str] = []
    probe_nodes = {n.get("name"): n for n in (probe or {}).get("nodes", []) if isinstance(n, dict) and n.get("name")}
    if cluster is not None:
        names = [n.name for n in cluster.nodes]
        cluster_nodes = {n.name: n for n in cluster.nodes}
        is_local = cluster.is_local if local is None else local
    elif probe_nodes:
        names = list(probe_nodes)
        cluster_nodes, is_local = {}, bool(local)
    else:
        count = nodes or 1
        is_local = True if local is None else local
        names = [f"local-{i}" if is_local else f"node-{i}" for i in range(count)]
        cluster_nodes = {}
    if nodes is not None and cluster is not None and nodes != len(names):
        raise UserError(f"--nodes {nodes} contradicts the cluster file's {len(names)} nodes; drop --nodes")
    if not names:
        raise UserError("the cluster has no nodes; add nodes to the cluster file")

    result: list[NodeResources] = []
    shared_local = is_local and cluster is None and len(names) > 1
    for name in names:
        facts = probe_nodes.get(name, {})
        node_cfg = cluster_nodes.get(name)
        gpus = [g for g in facts.get("gpus") or [] if isinstance(g, dict)]
        on_gpu = bool(gpus) and facts.get("flops_device", "cuda") == "cuda"
        ranks = len(gpus) if on_gpu else 1
        # Compute.
        if flops is not None:
            rank_flops = flops
        elif _positive(facts.get("flops")):
            rank_flops = float(facts["flops"])
            if shared_local:
                # Local workers split this machine's cores between them.
                rank_flops /= len(names)
        else:
            rank_flops = _local_or_assumed_flops(assumptions, name, is_local, len(names) if shared_local else 1)
        # Memory.
        if memory_bytes is not None:
            mem, kind = memory_bytes, "gpu" if on_gpu else "ram"
        elif on_gpu and _positive(gpus[0].get("memory_bytes")):
            mem, kind = float(min(g.get("memory_bytes") or 0 for g in gpus)), "gpu"
        elif _positive(facts.get("memory_bytes")):
            mem, kind = float(facts["memory_bytes"]), "ram"
        elif is_local:
            mem, kind = float(_local_memory_bytes()), "ram"
        else:
            mem, kind = float(ASSUMED_MEMORY_BYTES), "ram"
            assumptions.append(f"{name}: memory assumed {ASSUMED_MEMORY_BYTES / 2**30:.0f} GiB (no probe); run `vpscluster probe`")
        if kind == "ram" and shared_local and memory_bytes is None:
            mem /= len(names)  # local workers share this machine's RAM (a flag gives it per rank)
        result.append(NodeResources(
            name=name, flops=rank_flops, memory_bytes=mem, memory_kind=kind, ranks=ranks,
            disk_read_mb_s=facts.get("disk_read_mb_s") if _positive(facts.get("disk_read_mb_s")) else None,
            egress_quota_bytes=getattr(node_cfg, "egress_quota_bytes", None),
            egress_quota_period_s=getattr(node_cfg, "egress_quota_period_s", None),
        ))
    _dedupe_generic(assumptions)

    links = _links(names, probe, cluster_nodes, is_local, bandwidth_mbit, rtt_ms, assumptions)
    fit = _collective_fit(probe, sum(n.ranks for n in result))
    return Resources(result, links, fit, assumptions, measured=bool(probe_nodes))


def _links(names, probe, cluster_nodes, is_local, bandwidth_mbit, rtt_ms, assumptions) -> LinkMatrix:
    n = len(names)
    index = {name: i for i, name in enumerate(names)}
    if is_local and not cluster_nodes:
        default_bw, default_rtt = LOOPBACK_BANDWIDTH_MBIT, LOOPBACK_RTT_MS
    else:
        default_bw, default_rtt = ASSUMED_BANDWIDTH_MBIT, ASSUMED_RTT_MS
    bw = [[math.nan] * n for _ in range(n)]
    rtt = [[math.nan] * n for _ in range(n)]
    for link in (probe or {}).get("links", []) or []:
        if not isinstance(link, dict):
            continue
        i, j = index.get(link.get("src")), index.get(link.get("dst"))
        if i is None or j is None or i == j:
            continue
        if _positive(link.get("bandwidth_mbit")):
            bw[i][j] = float(link["bandwidth_mbit"])
        if isinstance(link.get("rtt_ms"), (int, float)) and link["rtt_ms"] >= 0:
            rtt[i][j] = float(link["rtt_ms"])
    missing_bw = missing_rtt = 0
    rtt_measured = [[not math.isnan(v) for v in row] for row in rtt]
    for i in range(n):
        for j in range(n):
            if i == j:
                bw[i][j], rtt[i][j] = math.inf, 0.0
                continue
            if bandwidth_mbit is not None:
                bw[i][j] = bandwidth_mbit
            elif math.isnan(bw[i][j]):
                missing_bw += 1
                adv = [getattr(cluster_nodes.get(names[k]), "advertised_bandwidth_mbit", None) for k in (i, j)]
                adv = [a for a in adv if a]
                bw[i][j] = min(adv) if adv else default_bw
            if rtt_ms is not None:
                rtt[i][j] = rtt_ms
            elif math.isnan(rtt[i][j]):
                # A round trip is symmetric: use the reverse direction if that one was measured.
                if rtt_measured[j][i]:
                    rtt[i][j] = rtt[j][i]
                else:
                    missing_rtt += 1
                    rtt[i][j] = default_rtt
    if n > 1 and missing_bw and bandwidth_mbit is None:
        adv = any(getattr(c, "advertised_bandwidth_mbit", None) for c in cluster_nodes.values())
        source = "the cluster file's advertised_bandwidth" if adv else f"assumed {default_bw:g} Mbit/s"
        assumptions.append(f"bandwidth of {missing_bw} of {n * (n - 1)} links: {source} (not measured); run `vpscluster probe`")
    if n > 1 and missing_rtt and rtt_ms is None:
        assumptions.append(f"round-trip time of {missing_rtt} of {n * (n - 1)} links assumed {default_rtt:g} ms (not measured)")
    return LinkMatrix(list(names), bw, rtt)


def _collective_fit(probe: dict | None, world_size: int) -> dict[str, float] | None:
    """The probe's fitted all-reduce alpha/beta, when it was measured at this world size."""
    if not probe:
        return None
    candidates = []
    for key in ("collective_fit", "allreduce_fit", "fit"):
        if isinstance(probe.get(key), dict):
            candidates.append(probe[key])
    coll = probe.get("collectives")
    if isinstance(coll, dict):
        candidates.append(coll.get("fit") if isinstance(coll.get("fit"), dict) else coll)
    elif isinstance(coll, list):
        candidates.extend(c.get("fit") if isinstance(c.get("fit"), dict) else c for c in coll if isinstance(c, dict))
    for c in candidates:
        alpha = next((c[k] for k in ("alpha_s", "alpha") if _number(c.get(k))), None)
        beta = next((c[k] for k in ("beta_bytes_s", "beta_bytes_per_s", "beta") if _positive(c.get(k))), None)
        ws = c.get("world_size", world_size)
        if alpha is not None and beta is not None and ws == world_size:
            return {"world_size": world_size, "alpha_s": float(alpha), "beta_bytes_s": float(beta)}
    return None


def _local_or_assumed_flops(assumptions: list[str], name: str, is_local: bool, share: int) -> float:
    if is_local:
        measured = local_matmul_flops()
        assumptions.append(
            f"FLOP/s: a quick fp32 matmul measured here ({measured / 1e9:.0f} GFLOP/s"
            + (f", split over {share} local workers" if share > 1 else "") + "), not by the probe"
        )
        return measured / share
    assumptions.append(f"{name}: compute assumed {ASSUMED_CPU_FLOPS / 1e9:.0f} GFLOP/s fp32 (no probe); run `vpscluster probe`")
    return ASSUMED_CPU_FLOPS


_LOCAL_FLOPS: list[float] = []


def local_matmul_flops(seconds: float = 0.3) -> float:
    """fp32 1024^3 matmul FLOP/s on this machine (the probe's benchmark, with numpy), cached."""
    if _LOCAL_FLOPS:
        return _LOCAL_FLOPS[0]
    import time

    import numpy as np

    n = 1024
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((n, n), dtype=np.float32), rng.standard_normal((n, n), dtype=np.float32)
    a @ b
    done, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        a @ b
        done += 1
    value = 2.0 * n**3 * done / (time.perf_counter() - start)
    _LOCAL_FLOPS.append(value)
    return value


def _local_memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return ASSUMED_MEMORY_BYTES


def _dedupe_generic(assumptions: list[str]) -> None:
    """Collapse 'node-i: X assumed' lines that repeat for every node into one line."""
    seen: dict[str, int] = {}
    out = []
    for line in assumptions:
        key = line.split(": ", 1)[1] if ": " in line else line
        if key in seen:
            continue
        seen[key] = 1
        out.append(line if sum(1 for l in assumptions if l.endswith(key)) == 1 else f"every node: {key}")
    assumptions[:] = out


def _positive(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 and math.isfinite(v)


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
