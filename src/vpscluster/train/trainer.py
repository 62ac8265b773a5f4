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
- Time budget: at the strategy's sync points (`strategy.is_sync_point`: ddp every step, diloco
  the steps an outer update lands) the ranks agree through a one-integer all-reduce (MAX)
  whether any has spent the budget, so all stop after the same step, and that step is a sync
  point. No collective between sync points. With sync points many steps apart a rank votes to
  stop at the one nearest the budget (`_budget_spent`). Its time and bytes count as communication.
- Time-outs: the process group is created with `timeouts.startup_collective_s`, which covers
  every start-up collective (DDP's weight broadcast and shape check, DiLoCo's weight check,
  the checkpoint agreement of a resume); once start-up is over the same group's time-out is
  lowered to `timeouts.train_collective_s` (torchtitan's init/train time-outs), so a dead peer
  stops the job quickly instead of hanging it.
- Stopping: SIGTERM or SIGINT to a rank (Ctrl-C or SIGTERM to the launcher, `vpscluster stop`,
  the node-side guard of a launcher that is gone) only sets `stop_requested`. The flag rides on
  the same one-integer agreement as the time budget (at sync points: every step for ddp, every
  H/F steps for diloco, so a diloco stop waits for the next outer update and a large H can
  outlast `stop_grace_s`), so every rank stops after the same step, saves a checkpoint there (no final evaluation) and writes its report
  (`stopped_by: "stop_requested"`); `--resume` continues from it. While stopping, collectives
  time out after `timeouts.stop_grace_s`; past that the launcher kills what is left anyway.
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

from vpscluster import fsutil
from vpscluster.errors import UserError
from vpscluster.train import checkpoint, diskfull, events, exporter, metrics, prediction, replan, rundir, stopping
from vpscluster.train.config import TrainConfig
from vpscluster.train.shares import ShareController, even, look_every, offsets, rank_speeds, split
from vpscluster.train.stopping import STOP_REQUESTED, STOPPED_BY
from vpscluster.train.strategies.base import DistContext
from vpscluster.train.strategies.diloco import RETUNABLE

RECENT_LOSSES = 10
EXPORTERS = "exporters.json"  # where every rank's and node's metrics are served (rank 0 writes it)  # final_train_loss = mean of rank 0's last this-many step losses


def lr_at(cfg: TrainConfig, step: int) -> float:
    """Linear warm-up to the peak lr, then cosine decay to min_lr_ratio * peak at decay_steps()."""
    peak = cfg.peak_lr()
    if cfg.warmup_steps and step <= cfg.warmup_steps:
        return peak * step / cfg.warmup_steps
    horizon = cfg.decay_steps()
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, horizon - cfg.warmup_steps))
    floor = peak * cfg.min_lr_ratio
    return floor + (peak - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


# The job's key-value store, made once per process; every process group this process joins
# (a session closed and another started) gets a fresh prefix in it. Re-running env://
# rendezvous instead reuses the old keys: on torchrun's agent store (which outlives the group),
# or on rank 0's own store while a user's reference (their DDP model) keeps the old group
# alive, the second group then waits forever on keys of the first.
_STORE: Any = None
_JOINS = 0


def _job_store(timeout: timedelta):
    import torch.distributed as dist

    global _STORE, _JOINS
    if _STORE is None:
        _STORE, _, _ = next(dist.rendezvous("env://", timeout=timeout))
    _JOINS += 1
    return dist.PrefixStore(f"vpscluster/{_JOINS}", _STORE)


def init_distributed(cfg: TrainConfig, backend: str) -> DistContext:
    """Join the job torchrun started (env:// rendezvous) with the long start-up time-out."""
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
        timeout = timedelta(seconds=cfg.timeouts.startup_collective_s)
        dist.init_process_group(backend, store=_job_store(timeout), rank=rank, world_size=world, timeout=timeout)
        group = dist.group.WORLD
    else:
        group = None  # started without a launcher: a single process, nothing to join
    return DistContext(rank=rank, world_size=world, local_rank=local_rank, backend=backend, device=device, group=group)


def end_startup(ctx: DistContext, train_collective_s: float, groups: list | tuple = ()) -> None:
    """Start-up is over: from now on a collective of `ctx.group` (and of `groups`, a strategy's
    own, `Strategy.collective_groups`) that waits longer than `train_collective_s` fails (a dead
    or stuck peer) instead of the start-up time-out."""
    if ctx.group is None:
        return
    from torch.distributed import distributed_c10d

    # What torchtitan does after its first step; gloo and NCCL both honour it. A torch without
    # it keeps the start-up time-out (slower to notice a dead peer, never wrong).
    set_timeout = getattr(distributed_c10d, "_set_pg_timeout", None)
    if set_timeout is not None:
        for group in (ctx.group, *groups):
            set_timeout(timedelta(seconds=train_collective_s), group)


def _torch_version() -> str:
    import torch

    return torch.__version__


def threads_per_rank(configured: int | None, ranks_here: int) -> int:
    """Torch threads for one rank: `configured` if set, else the CPUs this machine really grants
    (affinity capped by the cgroup quota, `nodeside.facts.available_cpus`) shared among the
    `ranks_here` ranks on it. The one rule for training, local launch and calibration."""
    from vpscluster.nodeside.facts import available_cpus  # stdlib only

    return configured or max(1, available_cpus() // max(1, ranks_here))


def _set_threads(cfg: TrainConfig) -> int:
    import torch

    threads = threads_per_rank(cfg.threads_per_rank, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    torch.set_num_threads(threads)
    return threads


class Trainer:
    def __init__(self, cfg: TrainConfig, run_dir: Path, backend: str = "auto") -> None:
        self.cfg, self.run_dir = cfg, Path(run_dir)
        self.backend = backend
        self.stop_requested = False  # set by SIGTERM/SIGINT; acted on at the next sync point
        self.resumed_world_size: int | None = None  # the ranks of the checkpoint resumed from

    def _request_stop(self, signum, _frame) -> None:
        self.stop_requested = True

    def install_stop_handler(self) -> None:
        """SIGTERM/SIGINT ask for a stop with a checkpoint instead of killing the rank mid-step.
        `train` installs it once start-up is over: a rank stopped while it starts has nothing to save."""
        stopping.install_handler(self._request_stop)

    # ---- build ----------------------------------------------------------------------------
    def build(self) -> None:
        import torch
        import torch.distributed as dist

        from vpscluster.train.data import GlobalBatchSampler, ShardSampler, load_dataset
        from vpscluster.train.model import build_model, count_parameters
        from vpscluster.train.presets import get_preset
        from vpscluster.train.strategies import get_strategy_class

        cfg = self.cfg
        self.threads = _set_threads(cfg)
        self.ctx = ctx = init_distributed(cfg, self.backend)
        self.coll = checkpoint.Collectives(ctx.rank, ctx.world_size, ctx.local_rank, self._all_gather_object,
                                           self._broadcast_object if ctx.group is not None else None)
        self.events = events.event_writer(ctx.rank)
        self.metrics = metrics.metrics_log(ctx.rank, self.run_dir / rundir.METRICS)
        self.exporter = exporter.rank_exporter(cfg.exporters, ctx.rank, ctx.local_rank, os.getcwd())
        self.shape = get_preset(cfg.preset)
        self.dataset = load_dataset(cfg.data, self.shape.seq_len, cfg.val_fraction)
        self.strategy = get_strategy_class(cfg.strategy.name)(cfg.strategy, ctx)
        self.shares = None
        if cfg.strategy.micro_batches:  # uneven shares of one global stream (train/shares.py)
            s = cfg.strategy
            speeds = s.speeds
            if speeds is None and s.node_speeds:  # the probe's figures, by the node each rank runs on
                self._dist = dist if ctx.group is not None else None
                speeds = rank_speeds(self._all_gather_object(os.environ.get("VPSC_NODE", "local")), s.node_speeds)
            self.shares = ShareController.start(ctx.world_size, s.micro_batches, speeds, s.min_share, s.max_spread, s.balance)
            self.sampler = GlobalBatchSampler(self.dataset, cfg.seed, cfg.micro_batch())
        else:
            shard, num_shards = self.strategy.data_shard()
            self.sampler = ShardSampler(self.dataset, shard, num_shards, cfg.seed, cfg.micro_batch())
        self._window = [0.0, 0]  # compute seconds, micro-batches since the last rebalancing look
        self._look_every = look_every(cfg.strategy.rebalance_every,
                                      cfg.strategy.sync_every if self.strategy.micro_batches_are_steps else None)
        model = build_model(self.shape, cfg.seed, ctx.device)
        self.num_params = count_parameters(model)
        self.model = self.strategy.setup(model)
        self.optimizer = _adamw(self.strategy.unwrap(), cfg, fused=ctx.device.type == "cuda")
        self.totals = metrics.Totals()
        self.recent_losses: deque[float] = deque(maxlen=RECENT_LOSSES)
        self.step = 0
        self._dist = dist if ctx.group is not None else None
        self._torch = torch
        self.exporters = self._publish_exporters()
        self.prediction = prediction.load(self.run_dir)  # the plan's, written by the launcher
        self._samples: list[tuple[float, float]] = []  # this session's (step_s, comm_s), for it
        self.replanned: dict[str, Any] | None = None  # this session's re-made sync plan (train/replan.py)

    def _publish_exporters(self) -> list[dict[str, Any]]:
        """Every rank's exporter address, gathered; rank 0 writes them to exporters.json."""
        if not self.cfg.exporters:
            return []
        found = [e for e in self._all_gather_object(self.exporter.endpoint()) if e]
        if self.ctx.rank == 0:
            self._write_json(self.run_dir / EXPORTERS, {"exporters": found})
        return found

    def _write_json(self, path: Path, doc: dict[str, Any]) -> None:
        """Rank 0's run files (report.json, exporters.json): a full disk leaves the file out (one
        warning line; the `end` event still carries the report) instead of ending the run."""
        try:
            fsutil.write_json(path, doc)
        except OSError as e:
            if not diskfull.is_disk_full(e):
                raise
            print(f"warning: cannot write {path}: {e.strerror}; training goes on", file=sys.stderr, flush=True)

    def _outer_syncs(self) -> int | None:
        return getattr(self.strategy, "outer_steps", None)  # DiLoCo counts its outer syncs

    def _all_gather_object(self, obj: Any) -> list[Any]:
        if self.ctx.group is None:
            return [obj]
        out: list[Any] = [None] * self.ctx.world_size
        self._dist.all_gather_object(out, obj, group=self.ctx.group)
        return out

    def _broadcast_object(self, obj: Any, src: int) -> Any:
        box = [obj]
        self._dist.broadcast_object_list(box, src=src, group=self.ctx.group)
        return box[0]

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
            "shares": self.shares.state_dict() if self.shares is not None else None,
            "share_window": list(self._window),
        }

    def check_replicas(self) -> None:
        """Every rank holds the same replicated state (`Strategy.replica_sha256`: ddp's weights,
        diloco's global weights and momentum): one sha256 per rank, all-gathered. Run before
        every checkpoint, so a checkpoint never holds replicas that differ.

        On a mismatch the run stops (ReplicasDiverged, a `replicas_diverged` event) and this
        checkpoint is not written: the previous one was compared alike, so `--resume` (or the
        recovery loop, with --max-restarts) goes on from replicas that agree. Restoring in place
        would repeat what a resume does (every rank's model, optimizer, sampler and strategy state)
        with less checking, and going on would train and save replicas that have parted ways."""
        if self.ctx.group is None:
            return
        with self.strategy.comm.timed(0):  # a control message, uncounted like eval's and the shares' gathers
            digests = self._all_gather_object(self.strategy.replica_sha256())
        self._book_off_step_comm()
        if len(set(digests)) == 1:
            return
        self.events.emit("replicas_diverged", step=self.step, sha256=digests)
        by_digest: dict[str, list[int]] = {}
        for rank, d in enumerate(digests):
            by_digest.setdefault(d, []).append(rank)
        parts = "; ".join(f"ranks {', '.join(map(str, r))}: {d[:12]}" for d, r in by_digest.items())
        raise ReplicasDiverged(
            f"step {self.step}: the replicas differ across ranks ({parts}); the checkpoint of this step is not "
            f"written and the run stops: continue from the last checkpoint with vpscluster train --resume {self.run_dir}")

    def save_checkpoint(self) -> None:
        self.check_replicas()
        root = self.run_dir / rundir.CHECKPOINTS
        t0 = time.perf_counter()
        try:
            d = checkpoint.save(root, self.step, self._payload(), self.coll, self.cfg.keep_checkpoints)
        except checkpoint.CheckpointFailed as e:  # a full disk: keep training, the previous checkpoint stands
            self.events.emit("checkpoint_failed", step=self.step, reason=str(e))
            if self.ctx.rank == 0:
                print(f"warning: {e}; training goes on, the previous checkpoint is intact", file=sys.stderr, flush=True)
            return
        self.exporter.checkpoint(time.perf_counter() - t0)
        self.events.emit("checkpoint", step=self.step, path=str(d))

    def resume(self) -> None:
        point = checkpoint.find_and_load(self.run_dir / rundir.CHECKPOINTS, self.coll)
        if point.step is None:
            self.events.emit("resume", step=0, skipped=point.skipped)
            return
        p = point.payload
        resharded = point.recut  # the same on every rank: rank-local state is adapted alike
        self.strategy.unwrap().load_state_dict(p["model"])
        self.optimizer.load_state_dict(p["optimizer"])
        self.strategy.load_state_dict(self.strategy.reshard_state(p["strategy"]) if resharded else p["strategy"])
        self.sampler.load_state_dict(p["sampler"], recut=resharded)
        self._torch.set_rng_state(p["rng"]["torch"])
        if "cuda" in p["rng"]:
            self._torch.cuda.set_rng_state(p["rng"]["cuda"], self.ctx.device)
        self.totals = metrics.Totals.from_dict(p["totals"])
        self.recent_losses.extend(p["recent_losses"])
        if self.shares is not None and p.get("shares") is not None and not resharded:
            self.shares.load_state_dict(p["shares"])  # another world starts from its own shares
            self._window = list(p.get("share_window", [0.0, 0]))
        self.step = point.step
        self.resumed_world_size = point.world_size
        if self.ctx.rank == 0:
            metrics.truncate_after(self.run_dir / rundir.METRICS, self.step)
        self.events.emit("resume", step=self.step, skipped=point.skipped, world_size=self.ctx.world_size,
                         checkpoint_world_size=point.world_size, shard=point.shard, received=point.received)

    # ---- evaluation -----------------------------------------------------------------------
    def evaluate(self) -> float:
        """Validation loss: the mean loss over the same `eval_batches` batches, whoever computes
        them, of the weights every rank shares (`Strategy.eval_weights`: ddp's model, DiLoCo's
        global weights). The batches are split among the ranks by speed (the current shares'
        speeds, else evenly) and the per-batch losses gathered and summed in batch order, so
        every rank gets the figure one rank would compute alone, in a fraction of the time.
        (Every rank evaluating every batch made a 0.15-core node take 4x as long as a 0.6-core
        one for the same figure, and the others waited for it at the next collective.)"""
        torch = self._torch
        b = self.cfg.micro_batch()
        n = -(-min(self.cfg.eval_batches * b, self.dataset.num_val_samples) // b)  # as val_batches yields
        mine = self._eval_share(n)
        losses: dict[int, float] = {}
        with self.strategy.eval_weights() as module, torch.no_grad():
            module.eval()
            for i, (x, y) in enumerate(self.dataset.val_batches(self.cfg.eval_batches, b)):
                if i in mine:
                    losses[i] = module(x.to(self.ctx.device), y.to(self.ctx.device)).item()
            module.train()
        if self.ctx.group is not None:
            with self.strategy.comm.timed(0):
                for part in self._all_gather_object(losses):
                    losses.update(part)
            self._book_off_step_comm()
        val = sum(losses[i] for i in range(n)) / n
        self.metrics.log(step=self.step, val_loss=val)
        self.exporter.val_loss(val)
        self.events.emit("eval", step=self.step, val_loss=val)
        return val

    def _eval_share(self, n: int) -> range:
        """This rank's validation batches: a contiguous run, sized by the ranks' speeds."""
        if self.ctx.world_size == 1:
            return range(n)
        counts = split(self.shares.speeds, n, min_share=0) if self.shares is not None else even(self.ctx.world_size, n)
        start = offsets(counts)[self.ctx.rank]
        return range(start, start + counts[self.ctx.rank])

    # ---- the loop -------------------------------------------------------------------------
    def _agree_stop(self, over_budget: bool) -> int:
        """All ranks stop after the same step (`train/stopping.py`). 0: go on, 1: some rank spent
        the time budget, STOP_REQUESTED: some rank was asked to stop."""
        code = STOP_REQUESTED if self.stop_requested else int(over_budget)
        return stopping.agree(code, self.ctx, self.strategy.comm)

    def _budget_spent(self, elapsed: float, budget: float) -> bool:
        """This rank's vote at a sync point: stop here? (`stopping.StopVote.budget_spent`)"""
        return self._vote.budget_spent(self.step, elapsed, budget)

    def train(self, resume: bool) -> dict[str, Any] | None:
        self.build()
        cfg, torch = self.cfg, self._torch
        if resume:
            self.resume()
        end_startup(self.ctx, cfg.timeouts.train_collective_s, self.strategy.collective_groups())
        # From here a stop saves a checkpoint; before (rendezvous, start-up) it ends the rank at once.
        self.install_stop_handler()
        start_step = self.step
        self.events.emit(
            "start", world_size=self.ctx.world_size, start_step=start_step, max_steps=cfg.max_steps,
            strategy=self.strategy.describe(), preset=cfg.preset, num_params=self.num_params,
            backend=self.ctx.backend, threads_per_rank=self.threads, run_dir=str(self.run_dir),
            exporters=self.exporters,
        )
        self.exporter.start_outer_count(self._outer_syncs())
        if start_step == 0:
            self.totals.initial_val_loss = self.evaluate()
        val_loss, val_step = self.totals.initial_val_loss, 0
        eval_due = False  # a validation is due (diloco runs it where the next outer update lands)
        stopped_by = "max_steps"
        session_start = time.perf_counter()
        self._vote = stopping.StopVote(start_step)  # the last sync point's step and seconds into the session
        wall_before = self.totals.wall_seconds
        local_tokens = micro_tokens = cfg.micro_batch() * self.shape.seq_len
        global_micro = cfg.strategy.micro_batches or self.ctx.world_size
        model, opt, strategy = self.model, self.optimizer, self.strategy
        lr_scale = strategy.lr_scale()
        while self.step < cfg.max_steps:
            t0 = time.perf_counter()
            self.step += 1
            lr = lr_at(cfg, self.step) * lr_scale
            for group in opt.param_groups:
                group["lr"] = lr
            if self.shares is None:
                x, y = self.sampler.next_batch()
                x, y = x.to(self.ctx.device), y.to(self.ctx.device)
                loss = model(x, y)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(strategy.unwrap().parameters(), cfg.grad_clip)
                strategy.tokens_processed(local_tokens)  # before step: an outer sync in it weighs by them
                strategy.step(opt, self.step)
                loss_value, n_micro = loss.item(), 1
            else:
                loss_value, n_micro = self._shared_step()
                local_tokens = n_micro * micro_tokens
            opt.zero_grad(set_to_none=True)
            stop = 0
            if strategy.is_sync_point(self.step):  # ddp: every step; diloco: where an outer update lands
                over = cfg.time_budget_s is not None and self._budget_spent(time.perf_counter() - session_start, cfg.time_budget_s)
                stop = self._agree_stop(over)  # also when no budget is set: a stop may be requested any time
            comm_s, nbytes = strategy.comm.take()
            step_s = time.perf_counter() - t0
            self.totals.add_step(local_tokens, step_s, comm_s, nbytes)
            self.totals.wall_seconds = wall_before + (time.perf_counter() - session_start)
            if loss_value is not None:  # None: this rank ran no micro-batch this step
                self.recent_losses.append(loss_value)
            tokens = micro_tokens * global_micro
            extra = {"shares": list(self.shares.shares)} if self.shares is not None else {}
            self.metrics.log(
                step=self.step, loss=loss_value, lr=lr, step_seconds=step_s, compute_seconds=max(0.0, step_s - comm_s),
                comm_seconds=comm_s, tokens=tokens, bytes_sent=nbytes, **extra,
            )
            self.exporter.step(self.step, loss_value, tokens, local_tokens, step_s, comm_s, nbytes, self._outer_syncs())
            self._samples.append((step_s, comm_s))
            if len(self._samples) == prediction.WARMUP + prediction.K and (self.prediction is not None or self._replannable()):
                self._window_full()
            if self.step % cfg.log_every == 0:
                self.events.emit(
                    "step", step=self.step, max_steps=cfg.max_steps, loss=loss_value, lr=lr,
                    tokens_per_s=tokens / step_s if step_s > 0 else 0.0,
                    comm_share=self.totals.comm_seconds / max(1e-9, self.totals.compute_seconds + self.totals.comm_seconds),
                    **extra,
                )
            if self.shares is not None:
                session_step = self.step - start_step
                if session_step == 1:  # a session's first step pays one-off costs: not a speed
                    self._window = [0.0, 0]
                else:
                    self._window[0] += max(0.0, step_s - comm_s)
                    self._window[1] += n_micro
                # A first look early in every session (steps 2-3), then every rebalance_every
                # (DiLoCo: whole rounds, `shares.look_every`).
                if cfg.strategy.balance and (session_step == 3 or self.step % self._look_every == 0) \
                        and session_step > 1:
                    self._rebalance()
            last = stop or self.step == cfg.max_steps
            if last:
                stopped_by = STOPPED_BY.get(stop, "max_steps")
                break
            eval_due = eval_due or self.step % cfg.eval_every == 0
            if eval_due and strategy.eval_point(self.step):  # diloco: where an outer update lands
                val_loss, val_step, eval_due = self.evaluate(), self.step, False
            if self.step % cfg.checkpoint_every == 0:
                self.save_checkpoint()
        t_final = time.perf_counter()
        if stopped_by == "stop_requested":  # a stuck peer must not hold the stop past its grace
            end_startup(self.ctx, min(cfg.timeouts.train_collective_s, cfg.timeouts.stop_grace_s),
                        self.strategy.collective_groups())
            self.events.emit("stopping", step=self.step)
        strategy.finalize(self.step)
        # A last sync (DiLoCo ending mid-round) is communication too: count it, and its time.
        final_s, final_bytes = strategy.comm.take()
        self.totals.comm_seconds += final_s
        self.totals.bytes_sent += final_bytes
        self.exporter.communicated(final_bytes)
        self.totals.wall_seconds += time.perf_counter() - t_final
        if (val_step != self.step or val_loss is None) and stopped_by != "stop_requested":
            val_loss, val_step = self.evaluate(), self.step  # a stop saves its grace for the checkpoint
        if self.step > start_step or not _has_checkpoint(self.run_dir, self.step):
            self.save_checkpoint()
        report = self.build_report(val_loss, stopped_by, start_step)
        if report is not None:
            self._write_json(self.run_dir / rundir.REPORT, report)
            self.events.emit("end", report=report)
        return report

    def _shared_step(self) -> tuple[float | None, int]:
        """This rank's share of the step's micro-batches (see train/shares.py); returns (mean
        loss of its micro-batches or None, how many it ran). The optimizer step is included.

        ddp: each micro-batch's loss is scaled by world/total before backward and DDP averages
        over the world, so the gradient is the mean over the whole global batch - the even
        split's gradient - whatever the shares. All but the last backward run under no_sync; a
        rank with no micro-batch runs an empty batch (zero gradients) so it joins the all-reduce.
        diloco: every micro-batch is an inner step of its own (a faster rank does more per round);
        tokens are counted per micro-batch, so the outer average is weighted by them.
        """
        torch, cfg, strategy, opt = self._torch, self.cfg, self.strategy, self.optimizer
        model, device = self.model, self.ctx.device
        batches = self.sampler.next_step(self.shares.shares, self.ctx.rank)
        n = len(batches)
        micro_tokens = cfg.micro_batch() * self.shape.seq_len
        params = strategy.unwrap().parameters
        losses = []
        if strategy.micro_batches_are_steps:
            for i, (x, y) in enumerate(batches):
                loss = model(x.to(device), y.to(device))
                loss.backward()
                torch.nn.utils.clip_grad_norm_(params(), cfg.grad_clip)
                strategy.tokens_processed(micro_tokens)
                losses.append(loss.detach())
                if i < n - 1:
                    opt.step()
                    opt.zero_grad(set_to_none=True)
            strategy.step(opt, self.step)  # the last inner step, and the outer sync when due
        else:
            scale = self.ctx.world_size / cfg.strategy.micro_batches
            if n == 0:
                empty = torch.zeros((0, self.shape.seq_len), dtype=torch.long, device=device)
                (model(empty).sum() * 0.0).backward()
            for i, (x, y) in enumerate(batches):
                with strategy.no_sync(i < n - 1):
                    loss = model(x.to(device), y.to(device))
                    (loss * scale).backward()
                losses.append(loss.detach())
            torch.nn.utils.clip_grad_norm_(params(), cfg.grad_clip)
            strategy.tokens_processed(n * micro_tokens)
            strategy.step(opt, self.step)
        return (torch.stack(losses).mean().item() if losses else None), n

    def _rebalance(self) -> None:
        """All ranks share what they measured since the last look; each feeds the same figures
        to the same controller, so the new shares are identical everywhere."""
        window = self._window
        with self.strategy.comm.timed(0):
            measured = self._all_gather_object((float(window[0]), int(window[1])))
        self._book_off_step_comm()
        self._window = [0.0, 0]
        before = list(self.shares.shares)
        if self.shares.observe(measured, self.step):
            self.events.emit(
                "rebalance", step=self.step, shares_before=before, shares=list(self.shares.shares),
                speeds=[round(v, 4) for v in self.shares.speeds], rebalances=self.shares.rebalances,
                split_gap=round(self.shares.split_gap(), 4), batch_size=self.cfg.micro_batch(),
                sync_every=self.cfg.strategy.sync_every if self.strategy.micro_batches_are_steps else None,
            )

    def _book_off_step_comm(self) -> None:
        """A gather between steps (a look, the prediction's check) is communication of the run,
        booked to the totals now. Left in the strategy's counter, the next step would take it as
        its own and count that much less compute: after the first look, where the fast ranks wait
        seconds for the slowest, their next step showed 0 s of compute, the next window's speeds
        doubled, and the second look re-split 14:7:3 into 16:7:1 (bench uneven, 2026-12-04)."""
        seconds, nbytes = self.strategy.comm.take()
        self.totals.comm_seconds += seconds
        self.totals.bytes_sent += nbytes
        self.exporter.communicated(nbytes)

    def _replannable(self) -> bool:
        """Does this run re-make its sync plan on the measured step (train/replan.py)? DiLoCo with
        rule inputs from the launcher, on even shares (with uneven ones a loop step is several
        inner steps: the window would not measure one)."""
        s = self.cfg.strategy
        return s.replan is not None and hasattr(self.strategy, "retune") and not s.micro_batches \
            and self.ctx.world_size > 1

    def _window_full(self) -> None:
        """The correction window is full: every rank's summary gathered once (as communication);
        rank 0 records the corrected prediction (train/prediction.py), and every rank re-makes
        the sync plan where the measured step is far off the planned one (train/replan.py)."""
        with self.strategy.comm.timed(0):
            summaries = self._all_gather_object(prediction.rank_summary(self._samples))
        self._book_off_step_comm()
        if self.ctx.rank == 0 and self.prediction is not None:
            doc = prediction.compare(self.prediction, summaries, comm_every_step=self.strategy.name == "ddp")
            self.events.emit("prediction", step=self.step, predicted=doc["predicted"], measured=doc["measured"],
                             error=doc["error"], corrected=doc["corrected"])
        if not self._replannable():
            return
        s = self.cfg.strategy
        step_s = replan.measured_step(summaries)
        before = {k: getattr(s, k) for k in RETUNABLE}
        again = replan.plan_again(s.replan, step_s, self.ctx.world_size, before, s.overlap_steps)
        if again is None:
            return
        settings, reason = again
        self.strategy.retune(settings)  # the same figures on every rank: the same settings, this step
        self._look_every = look_every(s.rebalance_every, s.sync_every if self.strategy.micro_batches_are_steps else None)
        self.replanned = {"step": self.step, "planned_step_seconds": s.replan.step_seconds,
                          "planned_from": s.replan.step_source, "measured_step_seconds": step_s,
                          "before": before, "after": {k: getattr(s, k) for k in RETUNABLE}, "reason": reason}
        self.events.emit("replan", **self.replanned)

    def build_report(self, val_loss: float, stopped_by: str, start_step: int):
        """Gather every rank's totals; rank 0 returns the report (contract keys first)."""
        t = self.totals
        # Each rank's final weights, hashed once here: equal on every rank when the strategy keeps
        # replicas identical (DDP every step, DiLoCo after its final sync), and tests compare them.
        mine = {**t.to_dict(), "collective_busy_seconds": self.strategy.describe().get("collective_busy_seconds"),
                "exporter_cpu_seconds": self.exporter.cpu_seconds(),  # None without exporters
                "model_sha256": checkpoint.state_hash(self.strategy.unwrap().state_dict()),
                "prediction_summary": prediction.rank_summary(self._samples),
                # Log and metrics lines a full disk refused on this rank (train/diskfull.py).
                "log_lines_dropped": diskfull.DROPPED.count,
                # Which environment ran this rank (a provisioned venv shows here).
                "python": sys.executable, "torch": _torch_version()}
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
            # The ranks that checkpoint was taken with, where it was another number (a node lost or added).
            "resumed_from_world_size": (self.resumed_world_size
                                        if self.resumed_world_size not in (None, self.ctx.world_size) else None),
            "stopped_by": stopped_by,
            "preset": self.cfg.preset,
            "num_params": self.num_params,
            "strategy_details": self.strategy.describe(),
            # DiLoCo's settings the launcher chose from the plan (plan/sync_rule.py) and why.
            "strategy_planned": ({"keys": list(self.cfg.strategy.planned), "reason": self.cfg.strategy.planned_reason}
                                 if self.cfg.strategy.planned else None),
            # The sync plan re-made on this session's measured step (train/replan.py), or None.
            "strategy_replanned": self.replanned,
            "sync_failure_rate": self.strategy.describe().get("sync_failure_rate"),  # diloco's outer syncs
            # Log, metrics and event lines dropped because a node's disk was full, all ranks together.
            "log_lines_dropped": sum(r["log_lines_dropped"] for r in per_rank),
            "backend": self.ctx.backend,
            "threads_per_rank": self.threads,
            "per_rank": [
                {"rank": i, **{k: r[k] for k in ("compute_seconds", "comm_seconds", "wall_seconds", "bytes_sent", "collective_busy_seconds",
                                           "exporter_cpu_seconds", "model_sha256", "python", "torch",
                                           "log_lines_dropped")}}
                for i, r in enumerate(per_rank)
            ],
            "model_sha256": mine["model_sha256"],
            "optimizer_sha256": checkpoint.state_hash(self.optimizer.state_dict()),
            "run_dir": str(self.run_dir),
            # The plan's prediction vs this session's measurement, and its online correction.
            "prediction": (prediction.compare(self.prediction, [r["prediction_summary"] for r in per_rank],
                                              comm_every_step=self.strategy.name == "ddp")
                           if self.prediction is not None else None),
            **(
                {
                    "micro_batches": self.cfg.strategy.micro_batches,
                    "balance": self.cfg.strategy.balance,
                    "shares": list(self.shares.shares),
                    "speeds": [round(v, 4) for v in self.shares.speeds],
                    "rebalances": self.shares.rebalances,
                    "split_gap": round(self.shares.split_gap(), 4),
                    "share_history": self.shares.history,
                }
                if self.shares is not None
                else {}
            ),
        }

    def close(self) -> None:
        import gc

        import torch.distributed as dist

        if hasattr(self, "strategy"):  # build() may have failed before it got this far
            self.strategy.close()
        if hasattr(self, "metrics"):
            self.metrics.close()
        if hasattr(self, "exporter"):
            self.exporter.close()
        # Whatever holds the process groups (DDP's reducer, PowerSGD's state, the context) must be
        # gone before the groups are destroyed; destroyed under them, the process can abort at exit.
        for name in ("model", "strategy", "optimizer", "ctx", "coll"):
            self.__dict__.pop(name, None)
        gc.collect()
        if dist.is_initialized():
            dist.destroy_process_group()


class ReplicasDiverged(UserError):
    """The ranks' replicated state differs at a checkpoint (`Trainer.check_replicas`)."""


def _has_checkpoint(run_dir: Path, step: int) -> bool:
    return (checkpoint.step_dir(run_dir / rundir.CHECKPOINTS, step) / checkpoint.MANIFEST).exists()


def _adamw(model, cfg: TrainConfig, fused: bool):
    """AdamW with weight decay on matrices only (nanoGPT): not on biases, norms."""
    import torch

    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.peak_lr(), betas=(0.9, 0.95), fused=fused or None)
