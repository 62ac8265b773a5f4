"""The built-in trainer: the GPT, its data and its loop on top of the session API. Runs in every rank.

Like nanoGPT's train.py on top of `vpscluster.session` (the API a user's own loop uses):
`Session(...)` (the process group, the strategy, shares, metrics, exporter, events) -> data ->
model -> `session.setup(model)` -> optimizer -> `session.resume(optimizer)` -> the loop, one
`session.step` per step (`train/step_runner.py`: even or shared) -> `session.finalize()` (the
final sync) -> evaluation (`train/evaluate.py`) -> `session.save` -> report (`train/report.py`)
-> `session.shutdown()`. What is the GPT's own stays here: the model and its data, the learning
rate schedule, gradient clipping, evaluation, the plan's prediction and re-planning
(`train/replan.py`) and the report. The loop never branches on the strategy (see
strategies/base.py); metric and event sinks are null objects on ranks other than 0.

- Optimiser: AdamW (Loshchilov & Hutter, 2019) with weight decay on matrices only (nanoGPT),
  linear warm-up then cosine decay to min_lr_ratio * lr over `cfg.decay_steps()` — fixed by the
  first run, so a resume with a larger --max-steps follows the same schedule.
- Gradient clipping by global norm after the gradients are synchronised (same on all ranks).
- Evaluation: mean loss over the same `eval_batches` validation batches on every rank (no
  communication; every rank gets the same figure).
- Time budget (in the session, `train/stopping.py`): at the strategy's sync points (`strategy.is_sync_point`: ddp every step, diloco
  the steps an outer update lands) the ranks agree through a one-integer all-reduce (MAX)
  whether any has spent the budget, so all stop after the same step, and that step is a sync
  point. No collective between sync points. With sync points many steps apart a rank votes to
  stop at the one nearest the budget (`stopping.StopVote`). Its time and bytes count as communication.
- Time-outs: the process group is created with `timeouts.startup_collective_s`, which covers
  every start-up collective (DDP's weight broadcast and shape check, DiLoCo's weight check,
  the checkpoint agreement of a resume); once start-up is over the same group's time-out is
  lowered to `timeouts.train_collective_s` (torchtitan's init/train time-outs, `session/dist.py`),
  so a dead peer stops the job quickly instead of hanging it.
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
from pathlib import Path
from typing import Any

from vpscluster import fsutil
from vpscluster.session.core import ReplicasDiverged, Session
from vpscluster.train import checkpoint, diskfull, events, prediction, replan, rundir, step_runner
from vpscluster.train.config import TrainConfig
from vpscluster.train.evaluate import evaluate
from vpscluster.train.report import build_report

__all__ = ["EXPORTERS", "ReplicasDiverged", "Trainer", "lr_at", "threads_per_rank"]

EXPORTERS = "exporters.json"  # where every rank's and node's metrics are served (rank 0 writes it)


def lr_at(cfg: TrainConfig, step: int) -> float:
    """Linear warm-up to the peak lr, then cosine decay to min_lr_ratio * peak at decay_steps()."""
    peak = cfg.peak_lr()
    if cfg.warmup_steps and step <= cfg.warmup_steps:
        return peak * step / cfg.warmup_steps
    horizon = cfg.decay_steps()
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, horizon - cfg.warmup_steps))
    floor = peak * cfg.min_lr_ratio
    return floor + (peak - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


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

    # The session keeps the run's counters; these read (and, for a test driving one step, set) them.
    @property
    def step(self) -> int:
        return self.session.steps

    @step.setter
    def step(self, value: int) -> None:
        self.session.steps = value

    @property
    def shares(self):
        return self.session.shares

    @property
    def totals(self):
        return self.session.totals

    @property
    def recent_losses(self):
        return self.session.recent_losses

    @property
    def _window(self) -> list:
        return self.session.window

    @_window.setter
    def _window(self, value: list) -> None:
        self.session.window = value

    def _rebalance(self) -> None:
        """A rebalancing look now (`session/balance.py`)."""
        from vpscluster.session.balance import look

        look(self.session)

    def evaluate(self) -> float:
        return evaluate(self)

    def _eval_share(self, n: int) -> range:
        from vpscluster.train.evaluate import eval_share

        return eval_share(self.session, n)

    # ---- build ----------------------------------------------------------------------------
    def build(self, resume: bool = False) -> None:
        from vpscluster.session.config import SessionConfig
        from vpscluster.train.data import GlobalBatchSampler, ShardSampler, load_dataset
        from vpscluster.train.model import build_model, count_parameters
        from vpscluster.train.presets import get_preset

        cfg = self.cfg
        self.threads = _set_threads(cfg)
        # The session's settings are the run's own (one source); checkpoints are the loop's to take.
        scfg = SessionConfig(strategy=cfg.strategy, timeouts=cfg.timeouts, time_budget_s=cfg.time_budget_s,
                             seed=cfg.seed, run_dir=str(self.run_dir), checkpoint_every=0,
                             keep_checkpoints=cfg.keep_checkpoints, resume=resume, exporters=cfg.exporters)
        self.session = s = Session(scfg, self.backend)
        # Rank 0 speaks for the run; on a quorum every node's rank is rank 0 of its own replica
        # group, and replica group 0's speaks (the launcher reads the head's: launch/quorum.py).
        s.events = self.events = events.event_writer(s.strategy.data_shard()[0] if cfg.strategy.quorum else s.rank)
        s.resume_hint = f"vpscluster train --resume {self.run_dir}"
        self.ctx, self.strategy, self.coll = s.ctx, s.strategy, s.coll
        self.metrics, self.exporter = s.metrics, s.exporter
        self.shape = get_preset(cfg.preset)
        self.dataset = load_dataset(cfg.data, self.shape.seq_len, cfg.val_fraction)
        if s.shares is not None:  # uneven shares of one global stream (train/shares.py)
            self.sampler = GlobalBatchSampler(self.dataset, cfg.seed, cfg.micro_batch())
        else:
            shard, num_shards = self.strategy.data_shard()
            self.sampler = ShardSampler(self.dataset, shard, num_shards, cfg.seed, cfg.micro_batch())
        s.data, s.batch_size = self.sampler, cfg.micro_batch()
        self.micro_tokens = cfg.micro_batch() * self.shape.seq_len
        self.global_micro = cfg.strategy.micro_batches or s.world_size
        model = build_model(self.shape, cfg.seed, s.device)
        self.num_params = count_parameters(model)
        self.model = s.setup(model)
        self.optimizer = _adamw(self.strategy.unwrap(), cfg, fused=s.device.type == "cuda")
        self.exporters = self._publish_exporters()
        self.prediction = prediction.load(self.run_dir)  # the plan's, written by the launcher
        self.samples: list[tuple[float, float]] = []  # this session's (step_s, comm_s), for it
        self.replanned: dict[str, Any] | None = None  # this session's re-made sync plan (train/replan.py)

    def _publish_exporters(self) -> list[dict[str, Any]]:
        """Every rank's exporter address, gathered; rank 0 writes them to exporters.json."""
        if not self.cfg.exporters:
            return []
        found = [e for e in self.session.all_gather_object(self.exporter.endpoint()) if e]
        if self.session.is_main:
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

    def _shared_step(self) -> tuple[float | None, int]:
        """Loop step number `self.step` (set by the caller) on this rank's share, with the
        optimizer step (`step_runner.shared`): (mean loss of its micro-batches or None, how many
        it ran). The gradients stay for the caller to read and zero."""
        self.session.steps -= 1  # the session counts the step it runs
        _, loss, n = step_runner.shared(self, time.perf_counter(), self.optimizer.param_groups[0]["lr"])
        return loss, n

    # ---- the loop -------------------------------------------------------------------------
    def train(self, resume: bool) -> dict[str, Any] | None:
        self.build(resume)
        cfg, s, opt = self.cfg, self.session, self.optimizer
        if resume:
            s.resume(opt)
        # From here a stop saves a checkpoint; before (rendezvous, start-up) it ends the rank at once.
        s.begin()
        start_step = s.start_step
        self.events.emit(
            "start", world_size=s.world_size, start_step=start_step, max_steps=cfg.max_steps,
            strategy=self.strategy.describe(), preset=cfg.preset, num_params=self.num_params,
            backend=s.ctx.backend, threads_per_rank=self.threads, run_dir=str(self.run_dir),
            exporters=self.exporters,
        )
        if start_step == 0:
            s.totals.initial_val_loss = evaluate(self)
        val_loss, val_step = s.totals.initial_val_loss, 0
        eval_due = False  # a validation is due (diloco runs it where the next outer update lands)
        stopped_by = "max_steps"
        s.start_clock()
        lr_scale = self.strategy.lr_scale()
        while s.steps < cfg.max_steps:
            t0 = time.perf_counter()
            lr = lr_at(cfg, s.steps + 1) * lr_scale
            for group in opt.param_groups:
                group["lr"] = lr
            if s.shares is None:
                log = step_runner.even(self, t0, lr)
            else:
                log, _, _ = step_runner.shared(self, t0, lr)
            opt.zero_grad(set_to_none=True)
            step_s, comm_s = s.last_step
            self.samples.append((step_s, comm_s))
            if len(self.samples) == prediction.WARMUP + prediction.K and \
                    (self.prediction is not None or replan.replannable(self)):
                replan.window_full(self)
            if s.steps % cfg.log_every == 0:
                tot = s.totals
                self.events.emit(
                    "step", step=s.steps, max_steps=cfg.max_steps, loss=s.last_loss,
                    lr=lr, tokens_per_s=log["tokens"] / step_s if step_s > 0 else 0.0,
                    comm_share=tot.comm_seconds / max(1e-9, tot.compute_seconds + tot.comm_seconds),
                    **({"shares": log["shares"]} if "shares" in log else {}),
                )
            if s.should_stop or s.steps == cfg.max_steps:
                stopped_by = s.stopped_by or "max_steps"
                break
            eval_due = eval_due or s.steps % cfg.eval_every == 0
            if eval_due and self.strategy.eval_point(s.steps):  # diloco: where an outer update lands
                val_loss, val_step, eval_due = evaluate(self), s.steps, False
            if s.steps % cfg.checkpoint_every == 0:
                s.save(opt)
        s.finalize()  # the final sync (DiLoCo ending mid-round); a requested stop gets its grace
        if (val_step != s.steps or val_loss is None) and stopped_by not in ("stop_requested", "drained"):
            val_loss, val_step = evaluate(self), s.steps  # a stop saves its grace for the checkpoint; a drained node leaves
        if s.steps > start_step or not _has_checkpoint(self.run_dir, s.steps):
            s.save(opt)
        report = build_report(self, val_loss, stopped_by, start_step)
        if report is not None:
            self._write_json(self.run_dir / rundir.REPORT, report)
            self.events.emit("end", report=report)
        return report

    def close(self) -> None:
        import gc

        import torch.distributed as dist

        session = self.__dict__.get("session")  # build() may have failed before it got this far
        # Whatever holds the process groups (DDP's reducer, PowerSGD's state, the context) must be
        # gone before the groups are destroyed; destroyed under them, the process can abort at exit.
        for name in ("model", "strategy", "optimizer", "ctx", "coll"):
            self.__dict__.pop(name, None)
        if session is not None:
            session.shutdown()
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
    return torch.optim.AdamW(groups, lr=cfg.peak_lr(), betas=(0.9, 0.95), fused=fused or None)
