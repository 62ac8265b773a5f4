"""How much of a node's matmul FLOP/s a training step of this model reaches, measured here.

The probe measures each node's fp32 matmul FLOP/s (1024^3 matmuls, the best case). A training
step of vpscluster's GPT (vpscluster.train.model) with AdamW reaches a model-dependent share of
that: small matmuls, LayerNorm, softmax, the optimizer. `measure_efficiency` times a few real
steps (forward, backward, AdamW, zero_grad) on this machine, interleaved with the probe's very
matmul benchmark on the same threads, and returns the ratio of achieved training FLOP/s
(`ModelShape.flops_per_token`) to matmul FLOP/s. Interleaving cancels most of the noise of a
shared machine: both sides see the same contention. With a cluster it runs on the head node
(`calibrate_on_node`), under that node's own CPU quota and thread count, as training will.

This is a property of the model's kernels on this CPU architecture, measured without any
distributed run; it reaches every node through that node's own probe FLOP/s. Results are cached
in ~/.cache/vpscluster/calibration.json by shape, threads, torch version and CPU model.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from pathlib import Path

from vpscluster import fsutil
from vpscluster.plan.compute import ASSUMED_EFFICIENCY, Efficiency
from vpscluster.plan.resources import Resources
from vpscluster.plan.shapes import ModelSpec
from vpscluster.nodeside.facts import cpu_model

MAX_CALIBRATION_PARAMS = 60_000_000  # beyond this a CPU step takes too long to time here


def _cache_path() -> Path:
    return Path(os.path.expanduser("~/.cache/vpscluster/calibration.json"))


def _torch_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("torch")
    except PackageNotFoundError:
        return "none"


def _key(model: ModelSpec, threads: int, matmul_threads: int) -> str:
    s = model.shape
    shape = f"{s.d_model}x{s.n_layer}x{s.n_head}x{s.seq_len}x{s.vocab_size}x{s.d_ff}x{int(s.gated_mlp)}x{s.batch_size}"
    return f"{shape}|threads={threads}/{matmul_threads}|torch={_torch_version()}|cpu={cpu_model() or platform.machine()}"


def _matmul_flops(torch, seconds: float, threads: int | None = None) -> float:
    """FLOP/s of the probe's benchmark (1024^3 fp32 matmuls) on `threads` threads."""
    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        return _matmul_loop(torch, seconds)
    finally:
        torch.set_num_threads(before)


def _matmul_loop(torch, seconds: float) -> float:
    n = 1024
    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.matmul(a, b)
    done, start = 0, time.perf_counter()
    while True:
        torch.matmul(a, b)
        done += 1
        if time.perf_counter() - start >= seconds:
            break
    return 2.0 * n**3 * done / (time.perf_counter() - start)


def measure_efficiency(model: ModelSpec, threads: int | None = None, rounds: int = 5, steps_per_round: int = 2,
                       matmul_s: float = 0.5, matmul_threads: int | None = None) -> float:
    """Training FLOP/s (on `threads` threads) / the probe's matmul FLOP/s (on `matmul_threads`,
    the probe's thread count) for `model` at its batch size, on this machine."""
    import torch

    from vpscluster.train.model import GPT

    old_threads = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        torch.manual_seed(0)
        net = GPT(model.shape)
        opt = torch.optim.AdamW(net.parameters(), lr=1e-4, betas=(0.9, 0.95))
        s = model.shape
        x = torch.randint(0, s.vocab_size, (s.batch_size, s.seq_len))
        y = torch.randint(0, s.vocab_size, (s.batch_size, s.seq_len))

        def step():
            loss = net(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        step()  # warm-up: allocations, optimizer state
        flops_per_step = model.flops_per_token() * s.batch_size * s.seq_len
        ratios = []
        for _ in range(rounds):
            mm = _matmul_flops(torch, matmul_s, matmul_threads)
            t0 = time.perf_counter()
            for _ in range(steps_per_round):
                step()
            train = flops_per_step * steps_per_round / (time.perf_counter() - t0)
            mm = (mm + _matmul_flops(torch, matmul_s, matmul_threads)) / 2  # bracket the steps
            ratios.append(train / mm)
        return statistics.median(ratios)
    finally:
        torch.set_num_threads(old_threads)


def calibrate_on_node(cluster, model: ModelSpec, threads: int | None = None, matmul_threads: int | None = None,
                      timeout_s: float = 600.0) -> float:
    """Run `measure_efficiency` on the cluster's head node (its python needs torch, not vpscluster).

    On the node the benchmark sees the node's own CPU, quota and threads, as training will. The
    launcher's own package travels with the command (`nodeside.run_module`), so the node times
    exactly this code whether or not vpscluster is installed there.
    """
    import asyncio
    from dataclasses import asdict

    from vpscluster import nodeside
    from vpscluster.cluster.inventory import executor_for
    from vpscluster.errors import RemoteError

    node = cluster.head_node
    arg = json.dumps({"shape": asdict(model.shape), "threads": threads, "matmul_threads": matmul_threads})

    async def go():
        ex = executor_for(node, cluster)
        try:
            return await ex.run(nodeside.command(node.python, "run_module", "vpscluster.plan.calibrate", arg),
                                timeout_s=timeout_s, input=nodeside.package_archive())
        finally:
            await ex.close()

    result = asyncio.run(go())
    if not result.ok:
        raise RemoteError(f"calibration on {node.name} failed: {result.reason()}; run `vpscluster plan --calibrate` without --cluster")
    doc = nodeside.parse_json_output(result.stdout)
    if doc is None or "efficiency" not in doc:
        raise RemoteError(f"calibration on {node.name} printed no result")
    return float(doc["efficiency"])


def efficiency_for(model: ModelSpec, res: Resources, calibrate: bool = False, threads: int | None = None,
                   cluster=None, matmul_threads: int | None = None) -> Efficiency:
    """The calibrated efficiency for this model (measured now or cached), else the assumed one.

    With `calibrate` and a remote `cluster`, it is measured on the head node; otherwise here.
    """
    if any(n.memory_kind == "gpu" for n in res.nodes):
        return Efficiency(ASSUMED_EFFICIENCY["gpu"], "assumed")
    if model.num_params() > MAX_CALIBRATION_PARAMS or model.untied_head:
        return Efficiency(ASSUMED_EFFICIENCY["ram"], "assumed")
    from vpscluster.train.trainer import threads_per_rank

    # What one rank alone would run here (the trainer's rule: the CPUs granted, quota included).
    threads = threads_per_rank(threads, 1)
    matmul_threads = matmul_threads or threads
    key = _key(model, threads, matmul_threads)
    cache = _read_cache()
    if calibrate:
        remote = cluster is not None and not cluster.is_local
        value = (calibrate_on_node(cluster, model, threads, matmul_threads) if remote
                 else measure_efficiency(model, threads, matmul_threads=matmul_threads))
        cache[key] = {"efficiency": value, "measured_at_unix": time.time()}
        _write_cache(cache)
        return Efficiency(value, "calibrated")
    if key in cache:
        return Efficiency(float(cache[key]["efficiency"]), "calibrated")
    return Efficiency(ASSUMED_EFFICIENCY["ram"], "assumed")


def _read_cache() -> dict:
    return fsutil.read_cache(_cache_path())


def _write_cache(cache: dict) -> None:
    fsutil.write_cache(_cache_path(), cache)  # a read-only home: the value is still used for this plan


if __name__ == "__main__":  # run on a node by `calibrate_on_node` (nodeside.run_module): one JSON line out
    import sys

    from vpscluster.train.presets import ModelShape

    opts = json.loads(sys.argv[1])
    spec = ModelSpec("calibration", ModelShape(**opts["shape"]))
    value = measure_efficiency(spec, opts.get("threads"), matmul_threads=opts.get("matmul_threads"))
    print(json.dumps({"efficiency": value}), flush=True)
