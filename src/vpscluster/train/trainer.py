"""The training loop: build, train, evaluate, checkpoint, report. Runs in every rank.

Lifecycle (torchtitan's shape): distributed set-up -> data -> model -> strategy -> optimizer ->
resume -> loop -> final sync, evaluation, checkpoint -> report -> close. The loop never branches
on the strategy (see strategies/base.py); metric and event sinks are null objects on ranks other
than 0.

- Optimiser: AdamW (Loshchilov & Hutter, 2019) with weight decay on matrices only (nanoGPT),
  linear warm-up then cosine decay to min_lr_ratio * lr over `cfg.decay_steps()` — fixed by the
  first run, so a resume with a larger --max-steps follows the same schedule.
- Gradient clipping by global norm after the gradients are synchronised (same on all ranks).
- Evaluation: mean loss over the same `eval_batches` validation batches on every rank (no
  communication; every rank gets the same figure).
- Time budget: every step the ranks agree through a one-integer all-reduce (MAX) whether any
  has spent the budget, so all stop after the same step. Its time and bytes count as
  communication.
- Time-outs: the process group is created with `timeouts.startup_collective_s`; the training
  collectives run on a second group created with `timeouts.train_collective_s`, so a dead peer
  stops the job quickly instead of hanging it.
"""

from __future__ import annotations

import math
import os
import sys
import time
from collections import deque
from datetime import timedelta
from pathlib import Path
from typing import Any

from vpscluster.train import checkpoint, events, metrics, rundir
from vpscluster.train.config import TrainConfig
from vpscluster.train.strategies.base import DistContext, ring_allreduce_bytes

RECENT_LOSSES = 10  # final_train_loss = mean of rank 0's last this-many step losses


def lr_at(cfg: TrainConfig, step: int) -> float:
    """Linear warm-up to cfg.lr, then cosine decay to min_lr_ratio * lr at decay_steps()."""
    if cfg.warmup_steps and step <= cfg.warmup_steps:
        return cfg.lr * step / cfg.warmup_steps
    horizon = cfg.decay_steps()
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, horizon - cfg.warmup_steps))
    floor = cfg.lr * cfg.min_lr_ratio
    return floor + (cfg.lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def init_distributed(cfg: TrainConfig, backend: str) -> DistContext:
    """Join the job torchrun started (env:// rendezvous) and make the short-time-out group."""
    import torch
    import torch.distributed as dist

    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    device = torch.device("cuda", local_rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if "MASTER_ADDR" in os.environ:
        dist.init_process_group(backend, timeout=timedelta(seconds=cfg.timeouts.startup_collective_s))
        group = dist.new_group(timeout=timedelta(seconds=cfg.timeouts.train_collective_s))
    else:
        group = None  # started without a launcher: a single process, nothing to join
    return DistContext(rank=rank, world_size=world, local_rank=local_rank, backend=backend, device=device, group=group)


def available_cpus() -> int:
    """CPUs this process may really use: its affinity, capped by a cgroup CPU quota.

    A container or VPS slice limited to 0.45 of a core still shows every host core in
    os.cpu_count(); running that many intra-op threads only burns the quota faster and gets
    the process throttled mid-matmul, so the quota (rounded up) caps the thread count.
    """
    from vpscluster.probe.facts_script import cpu_quota_cores  # stdlib only

    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    quota = cpu_quota_cores()
    if quota:
        cpus = min(cpus, max(1, math.ceil(quota)))
    return max(1, cpus)


def _set_threads(cfg: TrainConfig) -> int:
    import torch

    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    threads = cfg.threads_per_rank or max(1, available_cpus() // local_ranks)
    torch.set_num_threads(threads)
    return threads


class Trainer:
    def __init__(self, cfg: TrainConfig, run_dir: Path, backend: str = "auto") -> None:
        self.cfg, self.run_dir = cfg, Path(run_dir)
        self.backend = backend

    # ---- build ----------------------------------------------------------------------------
    def build(self) -> None:
        import torch
        import torch.distributed as dist

        from vpscluster.train.data import ShardSampler, load_dataset
        from vpscluster.train.model import build_model, count_parameters
        from vpscluster.train.presets import get_preset
        from vpscluster.train.strategies import get_strategy_class

        cfg = self.cfg
        self.threads = _set_threads(cfg)
        self.ctx = ctx = init_distributed(cfg, self.backend)
        self.coll = checkpoint.Collectives(ctx.rank, ctx.world_size, ctx.local_rank, self._all_gather_object)
        self.events = events.event_writer(ctx.rank)
        self.metrics = metrics.metrics_log(ctx.rank, self.run_dir / rundir.METRICS)
        self.shape = get_preset(cfg.preset)
        self.dataset = load_dataset(cfg.data, self.shape.seq_len, cfg.val_fraction)
        self.strategy = get_strategy_class(cfg.strategy.name)(cfg.strategy, ctx)
        shard, num_shards = self.strategy.data_shard()
        self.sampler = ShardSampler(self.dataset, shard, num_shards, cfg.seed, cfg.micro_batch())
        model = build_model(self.shape, cfg.seed, ctx.device)
        self.num_params = count_parameters(model)
        self.model = self.strategy.setup(model)
        self.optimizer = _adamw(self.strategy.unwrap(), cfg, fused=ctx.device.type == "cuda")
        self.totals = metrics.Totals()
        self.recent_losses: deque[float] = deque(maxlen=RECENT_LOSSES)
        self.step = 0
        self._dist = dist if ctx.group is not None else None
        self._torch = torch

    def _all_gather_object(self, obj: Any) -> list[Any]:
        if self.ctx.group is None:
            return [obj]
        out: list[Any] = [None] * self.ctx.world_size
        self._dist.all_gather_object(out, obj, group=self.ctx.group)
        return out

    # ---- checkpoints ----------------------------------------------------------------------
    def _payload(self) -> dict[str, Any]:
        torch = self._torch
        rng = {"torch": torch.get_rng_state()}
        if self.ctx.device.type == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state(self.ctx.device)
        return {
            "model": self.strategy.unwrap().state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "strategy": self.strategy.state_dict(),
            "sampler": self.sampler.state_dict(),
            "rng": rng,
            "totals": self.totals.to_dict(),
            "recent_losses": list(self.recent_losses),
        }

    def save_checkpoint(self) -> None:
        root = self.run_dir / rundir.CHECKPOINTS
        try:
            d = checkpoint.save(root, self.step, self._payload(), self.coll, self.cfg.keep_checkpoints)
        except checkpoint.CheckpointFailed as e:  # a full disk: keep training, the previous checkpoint stands
            self.events.emit("checkpoint_failed", step=self.step, reason=str(e))
            if self.ctx.rank == 0:
                print(f"warning: {e}; training goes on, the previous checkpoint is intact", file=sys.stderr, flush=True)
            return
        self.events.emit("checkpoint", step=self.step, path=str(d))

    def resume(self) -> None:
        point = checkpoint.find_and_load(self.run_dir / rundir.CHECKPOINTS, self.coll)
        if point.step is None:
            self.events.emit("resume", step=0, skipped=point.skipped)
            return
        p = point.payload
        self.strategy.unwrap().load_state_dict(p["model"])
        self.optimizer.load_state_dict(p["optimizer"])
        self.strategy.load_state_dict(p["strategy"])
        self.sampler.load_state_dict(p["sampler"])
        self._torch.set_rng_state(p["rng"]["torch"])
        if "cuda" in p["rng"]:
            self._torch.cuda.set_rng_state(p["rng"]["cuda"], self.ctx.device)
        self.totals = metrics.Totals.from_dict(p["totals"])
        self.recent_losses.extend(p["recent_losses"])
        self.step = point.step
        if self.ctx.rank == 0:
            metrics.truncate_after(self.run_dir / rundir.METRICS, self.step)
        self.events.emit("resume", step=self.step, skipped=point.skipped)

    # ---- evaluation -----------------------------------------------------------------------
    def evaluate(self) -> float:
        torch = self._torch
        module = self.strategy.eval_module()
        module.eval()
        losses = []
        with torch.no_grad():
            for x, y in self.dataset.val_batches(self.cfg.eval_batches, self.cfg.micro_batch()):
                losses.append(module(x.to(self.ctx.device), y.to(self.ctx.device)).item())
        module.train()
        val = sum(losses) / len(losses)
        self.metrics.log(step=self.step, val_loss=val)
        self.events.emit("eval", step=self.step, val_loss=val)
        return val

    # ---- the loop -------------------------------------------------------------------------
    def _agree_stop(self, over_budget: bool) -> bool:
        """All ranks stop after the same step: MAX over a one-integer all-reduce."""
        if self.ctx.group is None:
            return over_budget
        flag = self._torch.tensor([int(over_budget)], dtype=self._torch.int32, device=self.ctx.device)
        with self.strategy.comm.timed(ring_allreduce_bytes(flag.numel() * flag.element_size(), self.ctx.world_size)):
            self._dist.all_reduce(flag, op=self._dist.ReduceOp.MAX, group=self.ctx.group)
        return bool(flag.item())

    def train(self, resume: bool) -> dict[str, Any] | None:
        self.build()
        cfg, torch = self.cfg, self._torch
        if resume:
            self.resume()
        start_step = self.step
        self.events.emit(
            "start", world_size=self.ctx.world_size, start_step=start_step, max_steps=cfg.max_steps,
            strategy=self.strategy.describe(), preset=cfg.preset, num_params=self.num_params,
            backend=self.ctx.backend, threads_per_rank=self.threads, run_dir=str(self.run_dir),
        )
        if start_step == 0:
            self.totals.initial_val_loss = self.evaluate()
        val_loss, val_step = self.totals.initial_val_loss, 0
        stopped_by = "max_steps"
        session_start = time.perf_counter()
        wall_before = self.totals.wall_seconds
        local_tokens = cfg.micro_batch() * self.shape.seq_len
        model, opt, strategy = self.model, self.optimizer, self.strategy
        while self.step < cfg.max_steps:
            t0 = time.perf_counter()
            self.step += 1
            x, y = self.sampler.next_batch()
            x, y = x.to(self.ctx.device), y.to(self.ctx.device)
            lr = lr_at(cfg, self.step)
            for group in opt.param_groups:
                group["lr"] = lr
            loss = model(x, y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(strategy.unwrap().parameters(), cfg.grad_clip)
            strategy.tokens_processed(local_tokens)  # before step: an outer sync in it weighs by them
            strategy.step(opt, self.step)
            opt.zero_grad(set_to_none=True)
            over = cfg.time_budget_s is not None and time.perf_counter() - session_start >= cfg.time_budget_s
            stop = self._agree_stop(over) if cfg.time_budget_s is not None else False
            comm_s, nbytes = strategy.comm.take()
            step_s = time.perf_counter() - t0
            loss_value = loss.item()
            self.totals.add_step(local_tokens, step_s, comm_s, nbytes)
            self.totals.wall_seconds = wall_before + (time.perf_counter() - session_start)
            self.recent_losses.append(loss_value)
            tokens = local_tokens * self.ctx.world_size
            self.metrics.log(
                step=self.step, loss=loss_value, lr=lr, step_seconds=step_s, compute_seconds=max(0.0, step_s - comm_s),
                comm_seconds=comm_s, tokens=tokens, bytes_sent=nbytes,
            )
            if self.step % cfg.log_every == 0:
                self.events.emit(
                    "step", step=self.step, max_steps=cfg.max_steps, loss=loss_value, lr=lr,
                    tokens_per_s=tokens / step_s if step_s > 0 else 0.0,
                    comm_share=self.totals.comm_seconds / max(1e-9, self.totals.compute_seconds + self.totals.comm_seconds),
                )
            last = stop or self.step == cfg.max_steps
            if last:
                stopped_by = "time_budget" if stop else "max_steps"
                break
            if self.step % cfg.eval_every == 0:
                val_loss, val_step = self.evaluate(), self.step
            if self.step % cfg.checkpoint_every == 0:
                self.save_checkpoint()
        t_final = time.perf_counter()
        strategy.finalize(self.step)
        # A last sync (DiLoCo ending mid-round) is communication too: count it, and its time.
        final_s, final_bytes = strategy.comm.take()
        self.totals.comm_seconds += final_s
        self.totals.bytes_sent += final_bytes
        self.totals.wall_seconds += time.perf_counter() - t_final
        if val_step != self.step or val_loss is None:
            val_loss, val_step = self.evaluate(), self.step
        if self.step > start_step or not _has_checkpoint(self.run_dir, self.step):
            self.save_checkpoint()
        report = self.build_report(val_loss, stopped_by, start_step)
        if report is not None:
            rundir.write_json_atomic(self.run_dir / rundir.REPORT, report)
            self.events.emit("end", report=report)
        return report

    def build_report(self, val_loss: float, stopped_by: str, start_step: int):
        """Gather every rank's totals; rank 0 returns the report (contract keys first)."""
        t = self.totals
        mine = {**t.to_dict(), "collective_busy_seconds": self.strategy.describe().get("collective_busy_seconds")}
        per_rank = self._all_gather_object(mine)
        if self.ctx.rank != 0:
            return None
        wall = max(r["wall_seconds"] for r in per_rank)
        tokens = sum(r["tokens"] for r in per_rank)
        n = len(per_rank)
        return {
            "strategy": self.strategy.name,
            "world_size": self.ctx.world_size,
            "steps": self.step,
            "tokens": tokens,
            "wall_seconds": wall,
            "tokens_per_s": tokens / wall if wall > 0 else 0.0,
            "compute_seconds": sum(r["compute_seconds"] for r in per_rank) / n,
            "comm_seconds": sum(r["comm_seconds"] for r in per_rank) / n,
            "compute_utilization": sum(r["compute_seconds"] / r["wall_seconds"] for r in per_rank if r["wall_seconds"] > 0) / n,
            "final_train_loss": sum(self.recent_losses) / len(self.recent_losses) if self.recent_losses else None,
            "final_val_loss": val_loss,
            "bytes_sent": [r["bytes_sent"] for r in per_rank],
            # Beyond the contract: what the run was and how it ended.
            "initial_val_loss": t.initial_val_loss,
            "resumed_from_step": start_step or None,
            "stopped_by": stopped_by,
            "preset": self.cfg.preset,
            "num_params": self.num_params,
            "strategy_details": self.strategy.describe(),
            "sync_failure_rate": self.strategy.describe().get("sync_failure_rate"),  # diloco's outer syncs
            "backend": self.ctx.backend,
            "threads_per_rank": self.threads,
            "per_rank": [
                {"rank": i, **{k: r[k] for k in ("compute_seconds", "comm_seconds", "wall_seconds", "bytes_sent", "collective_busy_seconds")}}
                for i, r in enumerate(per_rank)
            ],
            "model_sha256": checkpoint.state_hash(self.strategy.unwrap().state_dict()),
            "optimizer_sha256": checkpoint.state_hash(self.optimizer.state_dict()),
            "run_dir": str(self.run_dir),
        }

    def close(self) -> None:
        import gc

        import torch.distributed as dist

        if hasattr(self, "strategy"):  # build() may have failed before it got this far
            self.strategy.close()
        if hasattr(self, "metrics"):
            self.metrics.close()
        # Whatever holds the process groups (DDP's reducer, PowerSGD's state, the context) must be
        # gone before the groups are destroyed; destroyed under them, the process can abort at exit.
        for name in ("model", "strategy", "optimizer", "ctx", "coll"):
            self.__dict__.pop(name, None)
        gc.collect()
        if dist.is_initialized():
            dist.destroy_process_group()


def _has_checkpoint(run_dir: Path, step: int) -> bool:
    return (checkpoint.step_dir(run_dir / rundir.CHECKPOINTS, step) / checkpoint.MANIFEST).exists()


def _adamw(model, cfg: TrainConfig, fused: bool):
    """AdamW with weight decay on matrices only (nanoGPT): not on biases, norms."""
    import torch

    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95), fused=fused or None)


def run(cfg: TrainConfig, run_dir: Path, resume: bool, backend: str = "auto") -> dict[str, Any] | None:
    trainer = Trainer(cfg, run_dir, backend)
    try:
        return trainer.train(resume)
    finally:
        trainer.close()
        sys.stdout.flush()
