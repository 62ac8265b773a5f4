"""Each node's compute time per step, measured on the model actually planned.

The probe's compute figure is a one-second 1024^3 matmul: noisy on a loaded machine and blind to
what a training step of a small model really costs (LayerNorm, softmax, the optimizer, Python).
Here every node runs a few training steps of the planned model at its real shape (preset, batch,
sequence length) with the quota-aware thread count the trainer will use
(`train.trainer.threads_per_rank`): forward, backward, gradient clipping, AdamW, zero_grad — the
trainer's step without communication. Warm-up steps are discarded; the rest are timed in repeats
(each long enough to outlast timer noise; up to twice as many when they disagree by more than
NOISY_SPREAD, within BUDGET_S) and summarised by `robust_summary`: the median of the repeats
(other jobs' spikes do not move it) and their spread, reported.

For a cluster of several ranks the same call also times one step with a DiLoCo outer sync's
own work in flight, per wire dtype (`sync_extra_s`): on a node with a small CPU quota the
sync's encode, decode, sums and outer step share the quota with the steps (about 1 s a sync for
`small` at 0.45 of a core), and the plan spreads that over the H steps of a round.

All nodes are measured at once, as they will train at once (on an emulated cluster they share
this machine's cores, and training sees that contention too); each node's ranks run as that many
concurrent processes for the same reason. Every call is time-bounded (`timeout_s`); a node that
fails or times out keeps the probe's figure, and the plan says so.

Results are cached per (node, model shape, threads, ranks, torch) in
~/.cache/vpscluster/steptime.json for `CACHE_MAX_AGE_S`, so repeated `plan` calls are fast;
`plan --calibrate` measures afresh.
"""

from __future__ import annotations

import json
import math
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from vpscluster import fsutil

WARMUP_STEPS = 2  # allocations, optimizer state, first-touch of pages: not a speed
REPEATS = 5
MIN_REPEAT_S = 0.3  # a repeat holds enough steps to outlast timer and scheduler noise
BUDGET_S = 25.0  # measuring time per node (after warm-up); at least 3 repeats are always taken
TIMEOUT_S = 180.0  # the whole remote call (python + torch import, warm-up, repeats)
CACHE_MAX_AGE_S = 12 * 3600.0
NOISY_SPREAD = 0.25  # repeats further apart than this (relative) ask for more repeats, and a note
OUTLIER_MADS = 3.0  # a repeat further than this many (scaled) MADs from the median is an outlier


@dataclass(frozen=True)
class StepTime:
    """One node's measured compute seconds per step (one rank, `tokens` tokens)."""

    node: str
    median_s: float
    spread: float  # (max - min) / median of the kept repeats
    repeats: int
    outliers: int
    threads: int
    tokens: int
    source: str  # "measured" | "cached"
    samples: tuple[float, ...] = ()
    # seconds one whole-model DiLoCo sync adds to its round here, per wire dtype (see `measure`)
    sync_extra_s: dict | None = None

    def to_dict(self) -> dict:
        d = asdict(self)
        d["samples"] = list(self.samples)
        return d


def robust_summary(samples: list[float], warmup: int = 0) -> dict:
    """Median, spread and outliers of per-step times; the first `warmup` samples are dropped.

    Pure. Outliers (beyond OUTLIER_MADS scaled median absolute deviations of the median, on
    either side) are counted and left out of the spread; the median is that of all kept samples
    (outliers included: the median already ignores them, and dropping only one side would bias it).
    """
    kept = [float(s) for s in samples[warmup:] if s is not None and math.isfinite(s) and s > 0]
    if not kept:
        raise ValueError("no valid step-time samples after the warm-up")
    med = statistics.median(kept)
    mad = 1.4826 * statistics.median(abs(s - med) for s in kept)
    tol = max(OUTLIER_MADS * mad, 0.01 * med)  # identical samples: a 1% band, not zero
    inliers = [s for s in kept if abs(s - med) <= tol]
    return {
        "median_s": med,
        "mean_s": statistics.fmean(kept),
        "min_s": min(inliers),
        "max_s": max(inliers),
        "spread": (max(inliers) - min(inliers)) / med,
        "repeats": len(kept),
        "outliers": len(kept) - len(inliers),
    }


def cache_key(node_id: str, shape: dict, threads: int | None, ranks: int, torch_version: str,
              cpu_share: float | None = None, world: int = 1) -> str:
    """The cache key: which node (and its CPU share where the probe knows it), the model's full
    shape including batch and sequence length, the configured threads, ranks, the world size
    (a sync's work depends on the number of chunks) and torch."""
    fields = ",".join(f"{k}={shape[k]}" for k in sorted(shape) if k != "trainable")
    share = "" if cpu_share is None else f"|share={cpu_share:g}"
    return f"{node_id}{share}|{fields}|threads={threads or 'auto'}|ranks={ranks}|world={world}|torch={torch_version}"


# ---- on the node --------------------------------------------------------------------------

def measure(shape, threads: int | None = None, ranks_here: int = 1, warmup: int = WARMUP_STEPS,
            repeats: int = REPEATS, budget_s: float = BUDGET_S, world: int = 1) -> dict:
    """Time the trainer's step (no communication) of `shape` here; per-step seconds per repeat.
    With `world` > 1 also what one DiLoCo outer sync among that many ranks adds to its round
    here, per wire dtype (`sync_extra_s`): one step with the sync's own work in flight
    (`diloco.time_step_with_sync`, the network left out) minus the median plain step."""
    import torch

    from vpscluster.train.model import build_model
    from vpscluster.train.trainer import threads_per_rank

    n_threads = threads_per_rank(threads, ranks_here)
    torch.set_num_threads(n_threads)
    net = build_model(shape, seed=0)
    decay = [p for p in net.parameters() if p.dim() >= 2]
    rest = [p for p in net.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                            lr=1e-4, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, shape.vocab_size, (shape.batch_size, shape.seq_len), generator=gen)
    y = torch.randint(0, shape.vocab_size, (shape.batch_size, shape.seq_len), generator=gen)

    def step() -> None:
        loss = net(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.item()

    warm = []
    for _ in range(max(1, warmup)):
        t0 = time.perf_counter()
        step()
        warm.append(time.perf_counter() - t0)
    per_repeat = max(1, math.ceil(MIN_REPEAT_S / max(1e-4, warm[-1])))
    samples: list[float] = []
    start = time.perf_counter()
    def settled() -> bool:  # enough repeats, and they agree (else up to twice as many, budget allowing)
        if len(samples) < repeats:
            return False
        return len(samples) >= 2 * repeats or robust_summary(samples)["spread"] <= NOISY_SPREAD

    while not settled() and (len(samples) < 3 or time.perf_counter() - start < budget_s):
        t0 = time.perf_counter()
        for _ in range(per_repeat):
            step()
        samples.append((time.perf_counter() - t0) / per_repeat)
    from vpscluster.nodeside.facts import cpu_facts

    sync_extra = None
    if world > 1:
        from vpscluster.train.strategies.diloco import time_step_with_sync
        from vpscluster.train.strategies.wire import CODECS

        plain = statistics.median(samples)
        sync_extra = {w: max(0.0, time_step_with_sync(net, step, w, world) - plain) for w in CODECS}
    return {"samples": samples, "warmup_samples": warm, "steps_per_repeat": per_repeat, "threads": n_threads,
            "tokens": shape.batch_size * shape.seq_len, "torch": torch.__version__.split("+")[0],
            "cpu_share": cpu_facts()["cpu_share"], "sync_extra_s": sync_extra}


# ---- from the controller ------------------------------------------------------------------

def _torch_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("torch").split("+")[0]
    except PackageNotFoundError:
        return "none"


def _node_id(node) -> str:
    return f"{node.name}@{node.host}:{node.port}" if not node.local else f"{node.name}@local"


def _cache_path() -> Path:
    from vpscluster.plan import calibrate

    return calibrate._cache_path().parent / "steptime.json"  # beside the efficiency cache


def _read_cache() -> dict:
    return fsutil.read_cache(_cache_path())


def _write_cache(cache: dict) -> None:
    now = time.time()
    fresh = {k: v for k, v in cache.items() if now - v.get("measured_at_unix", 0) < CACHE_MAX_AGE_S}
    fsutil.write_cache(_cache_path(), fresh)  # a read-only home: the figures still serve this plan


def _shape_dict(shape) -> dict:
    return {k: v for k, v in asdict(shape).items() if k != "trainable"}


def _run_on_nodes(cluster, shape, threads: int | None, ranks: dict[str, int], timeout_s: float,
                  world: int = 1) -> dict[str, dict | str]:
    """Measure on every node at once; node name -> the node's result or why it has none."""
    import asyncio

    from vpscluster import nodeside
    from vpscluster.cluster.inventory import executor_for

    async def one_rank(ex, node, n_ranks):
        arg = json.dumps({"shape": _shape_dict(shape), "threads": threads, "ranks": n_ranks, "world": world})
        if node.local:  # this machine: vpscluster is importable, no package to ship
            argv, stdin = [sys.executable, "-m", "vpscluster.plan.steptime", arg], None
        else:
            argv = nodeside.command(node.python, "run_module", "vpscluster.plan.steptime", arg)
            stdin = nodeside.package_archive()
        result = await ex.run(argv, timeout_s=timeout_s, input=stdin)
        if not result.ok:
            return f"failed: {result.reason()}"
        doc = nodeside.parse_json_output(result.stdout)
        return doc if doc and doc.get("samples") else "printed no result"

    async def one_node(node):
        ex = executor_for(node, cluster)
        try:
            n = ranks.get(node.name, 1)
            results = await asyncio.gather(*(one_rank(ex, node, n) for _ in range(n)), return_exceptions=True)
        finally:
            await ex.close()
        docs = [r for r in results if isinstance(r, dict)]
        if not docs:
            r = results[0]
            return f"{type(r).__name__}: {r}" if isinstance(r, BaseException) else r
        # The node's ranks run concurrently; the slowest sets the node's pace.
        return max(docs, key=lambda d: statistics.median(d["samples"]))

    async def go():
        outs = await asyncio.wait_for(asyncio.gather(*(one_node(n) for n in cluster.nodes), return_exceptions=True),
                                      timeout_s + 30.0)
        return {n.name: (o if not isinstance(o, BaseException) else f"{type(o).__name__}: {o}")
                for n, o in zip(cluster.nodes, outs)}

    return asyncio.run(go())


def node_step_times(cluster, shape, threads: int | None = None, ranks: dict[str, int] | None = None,
                    measure_now: bool = False, cpu_shares: dict[str, float] | None = None,
                    timeout_s: float = TIMEOUT_S, world: int = 1) -> tuple[dict[str, StepTime], list[str]]:
    """Per node: its compute seconds per step of `shape` (measured now, else cached), and notes
    (one line per node without a figure, or with a wide spread)."""
    ranks = ranks or {}
    cpu_shares = cpu_shares or {}
    tv = _torch_version()
    cache = _read_cache()
    now = time.time()
    key = {n.name: cache_key(_node_id(n), _shape_dict(shape), threads, ranks.get(n.name, 1), tv,
                             cpu_shares.get(n.name), world) for n in cluster.nodes}
    out: dict[str, StepTime] = {}
    notes: list[str] = []
    if measure_now:
        results = _run_on_nodes(cluster, shape, threads, ranks, timeout_s, world)
        for name, doc in results.items():
            if not isinstance(doc, dict):
                notes.append(f"{name}: step time not measured ({doc}); its probe FLOP/s is used")
                continue
            cache[key[name]] = {**doc, "measured_at_unix": now}
            out[name] = _step_time(name, doc, "measured")
        _write_cache(cache)
    else:
        for name, k in key.items():
            doc = cache.get(k)
            if doc and now - doc.get("measured_at_unix", 0) < CACHE_MAX_AGE_S:
                out[name] = _step_time(name, doc, "cached")
    for st in out.values():
        if st.spread > NOISY_SPREAD:
            notes.append(f"{st.node}: step time varied {st.spread:.0%} between repeats (a loaded node?); "
                         "the median is used")
    return out, notes


def _step_time(name: str, doc: dict, source: str) -> StepTime:
    s = robust_summary(doc["samples"])
    return StepTime(node=name, median_s=s["median_s"], spread=s["spread"], repeats=s["repeats"],
                    outliers=s["outliers"], threads=int(doc.get("threads") or 0), tokens=int(doc["tokens"]),
                    source=source, samples=tuple(doc["samples"]),
                    sync_extra_s=doc.get("sync_extra_s") if isinstance(doc.get("sync_extra_s"), dict) else None)


def apply(res, model, cluster=None, threads: int | None = None, measure_now: bool = False, probe: dict | None = None,
          timeout_s: float = TIMEOUT_S) -> dict | None:
    """Give each CPU node of `res` its measured compute seconds per step (`NodeResources.step_seconds`),
    measured now or from the cache; the plan's `step_calibration` document, or None when nothing
    applies (GPU nodes, a model too big to time on a CPU, nodes this machine cannot reach)."""
    from vpscluster.plan.calibrate import MAX_CALIBRATION_PARAMS

    if any(n.memory_kind == "gpu" for n in res.nodes):
        return None
    if model.num_params() > MAX_CALIBRATION_PARAMS or model.untied_head or not model.shape.trainable:
        return None
    if cluster is None:
        if not all(n.name.startswith("local-") for n in res.nodes):
            return None  # hypothetical nodes (or a probe without its cluster): nothing to run on
        from vpscluster.cluster.inventory import local_cluster

        where = local_cluster()  # the local workers: `len(res.nodes)` ranks on this machine
        ranks = {where.nodes[0].name: len(res.nodes)}
        targets = {n.name: where.nodes[0].name for n in res.nodes}
    else:
        where = cluster
        ranks = {n.name: n.ranks for n in res.nodes}
        targets = {n.name: n.name for n in res.nodes}
    shares = {}
    for f in (probe or {}).get("nodes", []) or []:
        if isinstance(f, dict) and isinstance(f.get("cpu_share"), (int, float)):
            shares[f.get("name")] = float(f["cpu_share"])
    found, notes = node_step_times(where, model.shape, threads, ranks, measure_now, shares, timeout_s,
                                   world=sum(n.ranks for n in res.nodes))
    if not found:
        return {"source": "none", "nodes": {}, "notes": notes} if measure_now else None
    for node in res.nodes:
        st = found.get(targets[node.name])
        if st is not None:
            node.step_seconds, node.step_tokens = st.median_s, st.tokens
            node.sync_extra_s = st.sync_extra_s
    return {
        "source": "measured" if measure_now else "cached",
        "nodes": {name: found[t].to_dict() for name, t in targets.items() if t in found},
        "notes": notes,
        "covers_all": all(t in found for t in targets.values()),
    }


def planned_efficiency(res, model, cluster=None, probe: dict | None = None, threads: int | None = None,
                       calibrate: bool = False, probe_threads: int | None = None):
    """What a plan computes on: each CPU node's step time on this model (measured now with
    `calibrate`, else cached; set on `res`), and the efficiency (implied by those step times when
    every node has one, else `calibrate.efficiency_for`). `vpscluster plan` and `train`'s own
    planning (`--strategy auto`, DiLoCo's rule) both use it, so they predict the same step.
    Returns (Efficiency, the plan's `step_calibration` document or None)."""
    from vpscluster.plan.calibrate import efficiency_for
    from vpscluster.plan.compute import Efficiency

    step_cal = apply(res, model, cluster, threads=threads, measure_now=calibrate, probe=probe)
    implied = implied_efficiency(model, res) if step_cal and step_cal.get("covers_all") else None
    if implied is not None:  # every node timed on this model: no separate efficiency run needed
        return Efficiency(implied, "calibrated"), step_cal
    eff = efficiency_for(model, res, calibrate=calibrate, threads=threads or probe_threads, cluster=cluster,
                         matmul_threads=probe_threads)
    return eff, step_cal


def implied_efficiency(model, res) -> float | None:
    """Training FLOP/s over the probe's matmul FLOP/s implied by the measured step times (median
    over nodes): what `plan.calibrate` estimates, read from the real steps instead."""
    ratios = [model.flops_per_token() * n.step_tokens / n.step_seconds / n.flops
              for n in res.nodes if n.step_seconds and n.flops]
    return statistics.median(ratios) if ratios else None


if __name__ == "__main__":  # on a node (nodeside.run_module) or here: one JSON line out
    from vpscluster.train.presets import ModelShape

    opts = json.loads(sys.argv[1])
    print(json.dumps(measure(ModelShape(**opts["shape"]), opts.get("threads"), int(opts.get("ranks") or 1),
                             world=int(opts.get("world") or 1))), flush=True)
