"""The collective sweep: all-reduce over message sizes across all nodes, and its α–β fit.

Bandwidths follow the nccl-tests conventions (NVIDIA, "nccl-tests/doc/PERFORMANCE.md"):
algbw = size / time, and for all-reduce busbw = algbw × 2(n−1)/n, the rate each link really
carries in a ring, comparable with the link matrix. The time of one all-reduce is fitted to the
Hockney (α–β) model t(m) = α + m/β (Hockney 1994, "The communication challenge for MPP") in two
steps, each on the messages that carry it: β from the sizes whose time the transfer dominates
(ordinary least squares, so the largest messages, like a gradient bucket, weigh most), then α on
relative error over every size with β held. One least-squares fit on relative error over all
sizes lets the small messages tilt the slope: on a token-bucket link the 64 KB message rides
the burst, and on a CPU-quota node the small ones wait for the scheduler, and either way that
fit put β 10% above the link itself (measured in the sandbox: 101.5 Mbit/s bus against a
100 Mbit/s link whose 16 MB all-reduce ran at 92.7).
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Sequence

from vpscluster import nodeside

DEFAULT_SIZES = tuple(4096 * 4**i for i in range(7))  # 4 KB .. 16 MB


@dataclass(frozen=True)
class SweepSettings:
    sizes: tuple[int, ...] = DEFAULT_SIZES
    min_time_s: float = 0.2  # per size
    max_iters: int = 50
    max_size_s: float = 1.5  # a single call slower than this ends the sweep (it is the last size)
    budget_s: float = 20.0  # no new size starts after this long
    init_timeout_s: float = 60.0
    timeout_s: float = 180.0  # the whole sweep


BANDWIDTH_BOUND = 4.0  # a size is bandwidth-bound where its transfer takes this many latencies


def fit_alpha_beta(sizes_bytes: Sequence[float], times_s: Sequence[float]) -> tuple[float, float | None]:
    """(α seconds, β bytes/s) of t(m) = α + m/β; α ≥ 0, β > 0.

    A first fit minimises Σ ((α + m/β − t) / t)² over every size. Where at least two sizes are
    bandwidth-bound by that fit (m/β ≥ 4α), β is fitted again on those alone by ordinary least
    squares and α re-fitted on relative error with it held (clamped at 0). Where the first fit
    gives a negative latency or a non-positive slope (noisy loopback times that do not grow
    with size), the slope alone is fitted through the origin (α = 0). β is None only when
    there is no size to fit a slope to.
    """
    alpha, gamma = _relative_fit(sizes_bytes, times_s)
    bound = [(m, t) for m, t in zip(sizes_bytes, times_s) if m * gamma >= BANDWIDTH_BOUND * alpha]
    if len({m for m, _ in bound}) >= 2:
        mm = sum(m for m, _ in bound) / len(bound)
        tt = sum(t for _, t in bound) / len(bound)
        slope = sum((m - mm) * (t - tt) for m, t in bound) / sum((m - mm) ** 2 for m, _ in bound)
        if slope > 0:
            gamma = slope
            w = [1.0 / t**2 for t in times_s]
            alpha = max(0.0, sum(wi * (t - m * gamma) for wi, m, t in zip(w, sizes_bytes, times_s)) / sum(w))
    return alpha, (1.0 / gamma if gamma and gamma > 0 else None)


def _relative_fit(sizes_bytes: Sequence[float], times_s: Sequence[float]) -> tuple[float, float]:
    """(α, 1/β) minimising relative error over every size, with the fallbacks above."""
    if not sizes_bytes:
        raise ValueError("no points to fit")
    w = [1.0 / t**2 for t in times_s]
    sw = sum(w)
    sm = sum(wi * m for wi, m in zip(w, sizes_bytes))
    smm = sum(wi * m * m for wi, m in zip(w, sizes_bytes))
    st = sum(wi * t for wi, t in zip(w, times_s))
    smt = sum(wi * m * t for wi, m, t in zip(w, sizes_bytes, times_s))
    det = sw * smm - sm * sm
    alpha, gamma = None, None
    if len(sizes_bytes) >= 2 and det > 0:
        alpha = (st * smm - sm * smt) / det
        gamma = (sw * smt - sm * st) / det
    if alpha is None or alpha < 0 or gamma is None or gamma <= 0:
        # latency cannot be negative nor time shrink with size: fit the slope alone
        alpha = 0.0
        gamma = smt / smm if smm > 0 else 0.0
    return alpha, gamma


def summarize(raw: dict, nodes: list[str]) -> dict:
    """The collectives record from rank 0's output: algbw, busbw per size and the α–β fit."""
    n = int(raw["world_size"])
    rows = []
    for r in raw["results"]:
        algbw = r["size_bytes"] / r["time_s"]
        rows.append({"size_bytes": r["size_bytes"], "time_s": r["time_s"], "iters": r["iters"],
                     "algbw_bytes_per_s": algbw, "busbw_bytes_per_s": algbw * 2 * (n - 1) / n,
                     "busbw_mbit": algbw * 2 * (n - 1) / n * 8 / 1e6, "correct": r["correct"]})
    alpha, beta = fit_alpha_beta([r["size_bytes"] for r in rows], [r["time_s"] for r in rows])
    out = {"op": "all_reduce", "backend": raw["backend"], "world_size": n, "nodes": nodes, "results": rows,
           "alpha_s": alpha, "beta_bytes_per_s": beta,
           "bus_beta_bytes_per_s": beta * 2 * (n - 1) / n if beta else None}
    wrong = [r["size_bytes"] for r in rows if not r["correct"]]
    if wrong:
        out["error"] = f"all-reduce returned wrong sums for sizes {wrong}"
    return out


async def run_sweep(nodes: Sequence, executors: dict, facts: dict[str, dict], settings: SweepSettings) -> dict:
    """All-reduce sweep with one process per node (nodes[0] hosts the rendezvous)."""
    head = nodes[0]
    names = [n.name for n in nodes]
    backend = "nccl" if all(facts[n.name].get("cuda_available") and facts[n.name].get("nccl_available")
                            for n in nodes) else "gloo"
    port_cmd = nodeside.command(head.python, "free_port")
    got = await executors[head.name].run(port_cmd, timeout_s=30)
    if not got.ok or not got.stdout.strip().isdigit():
        return {"op": "all_reduce", "nodes": names, "error": f"no free port on {head.name}: {got.reason()}"}
    port = got.stdout.strip()
    opts = {"sizes": list(settings.sizes), "min_time_s": settings.min_time_s, "max_iters": settings.max_iters,
            "max_size_s": settings.max_size_s, "budget_s": settings.budget_s,
            "timeout_s": settings.init_timeout_s, "backend": backend}
    async def one(rank: int, node):
        env = {"RANK": str(rank), "WORLD_SIZE": str(len(nodes)), "LOCAL_RANK": "0",
               "MASTER_ADDR": head.host, "MASTER_PORT": port}
        iface = facts[node.name].get("interface")
        if iface and (iface != "lo" or head.host.startswith("127.")):
            # gloo would otherwise pick the interface of the hostname, which may not route between nodes.
            env["GLOO_SOCKET_IFNAME"] = env["NCCL_SOCKET_IFNAME"] = iface
        return await executors[node.name].run(nodeside.command(node.python, "allreduce", json.dumps(opts)),
                                              timeout_s=settings.timeout_s, env=env)

    results = await asyncio.gather(*(one(i, n) for i, n in enumerate(nodes)))
    raw = nodeside.parse_json_output(results[0].stdout) if results[0].stdout else None
    if raw is None or not all(r.ok for r in results):
        bad = next((r for r in results if not r.ok), results[0])
        return {"op": "all_reduce", "backend": backend, "nodes": names, "error": f"{bad.node}: {bad.reason()}"}
    return summarize(raw, names)
