"""`ddp`: DistributedDataParallel with measured (and optionally compressed) gradient all-reduce.

Every step each rank's gradients are averaged by DDP's bucketed all-reduce, which overlaps the
communication of early buckets with the backward computation of later ones (Li et al., 2020,
"PyTorch Distributed"). A DDP communication hook wraps the hook that does the reduction:

- `compress: none`  — torch's `allreduce_hook`: fp32 on the wire.
- `compress: bf16`  — torch's `bf16_compress_hook`: the bucket is cast to bfloat16 for the
  all-reduce (half the bytes) and cast back.
- `compress: powersgd` — torch's `powerSGD_hook` (Vogels et al., 2019, "PowerSGD: Practical
  Low-Rank Gradient Compression"): each gradient matrix M (n x m) is sent as its rank-r factors
  P (n x r) and Q (m x r), with error feedback (what compression dropped is added back next
  step) and warm start; vectors (biases, norms) are all-reduced uncompressed.

A ddp session on uneven nodes gives the ranks batches of different sizes; each bucket is then
scaled before the hook so the average weighs every sample alike (`weigh_batch`, `_weighted`).

What is measured, per step, on this rank:

- bytes sent: every all-reduce the hook issues is counted as it is issued (including PowerSGD's
  P, Q and uncompressed-vector all-reduces), with the tensor's real dtype, as a ring all-reduce
  sends it: 2(n-1)/n of the buffer (`ring_allreduce_bytes`). Counting sits in a thin proxy in
  front of `torch.distributed` inside torch's hook modules, so the numbers are what the hooks
  really sent, not a formula applied to the model size.
- exposed communication seconds (`comm_seconds`, what costs wall time): the time between the
  moment the last gradient bucket became ready (all backward compute done) and the moment the
  last all-reduce finished. DDP's backward only returns once every bucket is reduced, so this is
  exactly the part of the step spent waiting on the network; communication hidden under the
  backward of later layers costs nothing and is not counted. Work a hook does after the last
  bucket is ready (bf16 casts, PowerSGD's factorisation and orthogonalisation) is part of
  synchronising and counts as communication too. Hence
  compute_seconds = step_seconds - comm_seconds is honest and compute_utilization =
  compute / wall.
- busy seconds (`collective_busy_seconds` in `describe()`): the union of the intervals during
  which at least one all-reduce was in flight (from its hook call to its completion), overlap
  included — the total time the network was in use.

PowerSGD over gloo uses one bucket for the whole model. Its hook issues its P and Q all-reduces
from the callbacks of earlier ones, which gloo runs on its own threads: with several buckets the
main thread's next bucket races them, the ranks issue collectives in different orders, and gloo
fails ("Received data size doesn't match expected size"; seen with 4 ranks of `small`, two 25-MiB
buckets). With one bucket every collective of a step is issued in one chain. The planner already
treats PowerSGD as one exposed sync per step. NCCL orders them on its stream, so buckets stay.

Resume: `compress: none` and `bf16` resume bit-exactly; `powersgd` keeps its error feedback and
factors but runs two uncompressed steps after a resume (see `load_state_dict`).

Not counted: DDP's one-off broadcast of the initial weights in its constructor (before step 1).
At world size 1 there is nothing to synchronise: no wrapper, no hook, no bytes.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any

from vpscluster.train.strategies.base import Strategy, ring_allreduce_bytes

# The strategy whose counters the proxy feeds (one training strategy per process).
_ACTIVE: "DDPStrategy | None" = None


class _CountingDist:
    """Stands in for `torch.distributed` inside torch's hook modules; counts all_reduce bytes."""

    def __init__(self, real: Any) -> None:
        self._real = real

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def all_reduce(self, tensor, op=None, group=None, async_op=False):
        active = _ACTIVE
        if active is not None:
            size = group.size() if group is not None else self._real.get_world_size()
            active._count_bytes(ring_allreduce_bytes(tensor.numel() * tensor.element_size(), size))
        if op is None:
            return self._real.all_reduce(tensor, group=group, async_op=async_op)
        return self._real.all_reduce(tensor, op=op, group=group, async_op=async_op)


def _install_counting_proxy() -> None:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    for module in (default_hooks, powerSGD_hook):
        if not isinstance(module.dist, _CountingDist):
            module.dist = _CountingDist(module.dist)


def bucket_cap_mb(model, bucket_mb: float, compress: str, backend: str) -> float:
    """DDP's bucket size: `bucket_mb`, or the whole model for PowerSGD over gloo (one bucket; see the module)."""
    if compress != "powersgd" or backend != "gloo":
        return bucket_mb
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    return max(bucket_mb, grad_bytes / 2**20 + 1.0)


class DDPStrategy(Strategy):
    name = "ddp"

    def setup(self, model):
        self._model = model
        self._ddp = None
        self._powersgd = None
        self._lock = threading.Lock()
        self._intervals: list[list[float]] = []  # [ready_time, done_time] per all-reduce this step
        self._bytes = 0
        self.busy_seconds = 0.0
        self.batch_weight = 1.0  # this rank's gradient in the average (`weigh_batch`)
        if not self.ctx.is_distributed:
            return model

        import torch
        from torch.nn.parallel import DistributedDataParallel
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

        global _ACTIVE
        _install_counting_proxy()
        _ACTIVE = self
        device = torch.device(self.ctx.device)
        compress = self.config.compress
        self._ddp = DistributedDataParallel(
            model,
            device_ids=[device.index] if device.type == "cuda" else None,
            process_group=self.ctx.group,
            bucket_cap_mb=bucket_cap_mb(model, self.config.bucket_mb, compress,
                                        torch.distributed.get_backend(self.ctx.group)),
            gradient_as_bucket_view=True,
        )
        if compress == "powersgd":
            self._powersgd = powerSGD_hook.PowerSGDState(
                process_group=self.ctx.group,
                matrix_approximation_rank=self.config.powersgd_rank,
                start_powerSGD_iter=self.config.powersgd_start_step,
                use_error_feedback=True,
                warm_start=True,
                random_seed=0,
            )
            inner, state = powerSGD_hook.powerSGD_hook, self._powersgd
        elif compress == "bf16":
            inner, state = default_hooks.bf16_compress_hook, self.ctx.group
        else:
            inner, state = default_hooks.allreduce_hook, self.ctx.group
        self._ddp.register_comm_hook(state, self._timed(self._weighted(inner)))
        return self._ddp

    def weigh_batch(self, weight: float) -> None:
        """This rank's gradient counts `weight` times in the average from the next backward on
        (`_weighted`): a ddp session's uneven shares (`session/shard.py`) give rank i a batch of
        b_i samples and the weight world * b_i / sum(b)."""
        self.batch_weight = float(weight)

    def _weighted(self, inner):
        """Uneven batches (`weigh_batch`): each hook below averages the ranks' buckets (divides
        their sum by the world size), and the script's loss is a mean over its own batch, so a
        plain average would count a sample of a small batch more than one of a big batch. The
        bucket is scaled in place by world * b_i / sum(b) first, so the average is
        sum_i b_i g_i / sum(b): the gradient of the mean loss over all the step's samples, as one
        process would compute it on their union. Before the hook, so it holds for every
        `compress` (bf16 casts the scaled bucket; PowerSGD compresses it, its error feedback in the
        same units while the weights hold) and for gloo and NCCL alike (an in-place multiply on
        the bucket's device, then the hook's own async all-reduce and future). At weight 1 (even
        batches) nothing is touched: an even run's bits are unchanged."""

        def hook(state, bucket):
            w = self.batch_weight
            if w != 1.0:
                bucket.buffer().mul_(w)
            return inner(state, bucket)

        return hook

    def _timed(self, inner):
        """Wrap a DDP comm hook: note when its bucket was ready and when its reduction finished."""

        def hook(state, bucket):
            interval = [time.perf_counter(), 0.0]
            with self._lock:
                self._intervals.append(interval)
            fut = inner(state, bucket)

            def done(f):
                interval[1] = time.perf_counter()
                return f.value()

            return fut.then(done)

        return hook

    def _count_bytes(self, nbytes: int) -> None:
        with self._lock:
            self._bytes += nbytes

    def _take_step_comm(self) -> tuple[float, float, int]:
        """(exposed seconds, busy seconds, bytes) of the all-reduces since the last call."""
        with self._lock:
            intervals, nbytes = self._intervals, self._bytes
            self._intervals, self._bytes = [], 0
        done = [iv for iv in intervals if iv[1] > 0]
        if not done:
            return 0.0, 0.0, nbytes
        exposed = max(0.0, max(iv[1] for iv in done) - max(iv[0] for iv in done))
        busy, end = 0.0, float("-inf")
        for start, stop in sorted(done):  # union of the in-flight intervals
            start = max(start, end)
            if stop > start:
                busy += stop - start
            end = max(end, stop)
        return exposed, busy, nbytes

    def no_sync(self, accumulating: bool):
        if accumulating and self._ddp is not None:
            return self._ddp.no_sync()
        return contextlib.nullcontext()

    def step(self, optimizer, step: int) -> None:
        exposed, busy, nbytes = self._take_step_comm()
        self.comm.add(exposed, nbytes)
        self.busy_seconds += busy
        optimizer.step()

    def unwrap(self):
        return self._model

    def state_dict(self) -> dict[str, Any]:
        if self._powersgd is None:
            return {}
        s = self._powersgd
        # Error feedback and warm-start factors are rank-local state PowerSGD needs to continue.
        return {
            "powersgd": {
                "iter": s.iter,
                "error_dict": s.error_dict,
                "p_memory_dict": s.p_memory_dict,
                "q_memory_dict": s.q_memory_dict,
                "rng": s.rng.get_state(),
            }
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not state:
            return
        if "powersgd" not in state or self._powersgd is None:
            raise ValueError(f"ddp strategy state {sorted(state)} does not match compress={self.config.compress}")
        saved, s = state["powersgd"], self._powersgd
        s.iter = saved["iter"]
        s.error_dict, s.p_memory_dict, s.q_memory_dict = saved["error_dict"], saved["p_memory_dict"], saved["q_memory_dict"]
        s.rng.set_state(saved["rng"])
        # A new process's DDP lays its buckets out in parameter order for the first iteration and
        # rebuilds them in gradient-ready order after it; the saved error and factors are in the
        # rebuilt layout. Plain all-reduce for two steps lets the rebuild happen before PowerSGD
        # uses them again (else the residual would be added at the wrong positions). A resumed
        # powersgd run therefore differs from an uninterrupted one by those two exact steps.
        s.start_powerSGD_iter = max(s.start_powerSGD_iter, s.iter + 2)

    def describe(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "compress": self.config.compress}
        if self.config.compress == "powersgd":
            out["powersgd_rank"] = self.config.powersgd_rank
        out["collective_busy_seconds"] = round(getattr(self, "busy_seconds", 0.0), 6)
        return out

    def close(self) -> None:
        global _ACTIVE
        if _ACTIVE is self:
            _ACTIVE = None
        # Drop the wrapper and PowerSGD's state (both hold the process group) before it is destroyed.
        self._ddp = None
        self._powersgd = None
