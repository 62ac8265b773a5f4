"""The training configuration: one typed tree, built from defaults, `--config FILE.yaml`, then flags.

Cross-field rules live in `validate` methods, in one place. Derived values (the batch size a
preset implies, the run directory) are computed by methods, never stored twice.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Literal

from vpscluster.errors import UserError

StrategyName = Literal["ddp", "diloco", "auto"]


@dataclass
class StrategyConfig:
    """How ranks keep their models in agreement (see `train/strategies/`)."""

    name: str = "ddp"
    # ddp: gradient compression through a DDP communication hook.
    compress: Literal["none", "bf16", "powersgd"] = "none"
    powersgd_rank: int = 4
    # PowerSGD (Vogels et al., 2019) runs plain all-reduce for its first steps: DDP rebuilds its
    # buckets after step 1 and a short uncompressed warm-up protects accuracy. Must be >= 2.
    powersgd_start_step: int = 10
    bucket_mb: float = 25.0
    # diloco (Douillard et al., 2023): H inner steps, then an outer Nesterov-SGD step on the
    # token-weighted average pseudo-gradient.
    sync_every: int = 100
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    wire_dtype: Literal["fp32", "bf16", "int8"] = "fp32"
    # Streaming DiLoCo (Douillard et al., 2025): the model split into this many fragments, each
    # synced at a staggered step, so traffic is spread over the round. 1 = no streaming.
    fragments: int = 1

    def validate(self) -> None:
        if self.powersgd_rank < 1:
            raise UserError(f"strategy.powersgd_rank must be at least 1, got {self.powersgd_rank}")
        if self.powersgd_start_step < 2:
            raise UserError(f"strategy.powersgd_start_step must be at least 2, got {self.powersgd_start_step}")
        if self.bucket_mb <= 0:
            raise UserError(f"strategy.bucket_mb must be positive, got {self.bucket_mb}")
        if self.sync_every < 1:
            raise UserError(f"strategy.sync_every (H) must be at least 1, got {self.sync_every}")
        if self.outer_lr <= 0:
            raise UserError(f"strategy.outer_lr must be positive, got {self.outer_lr}")
        if not 0 <= self.outer_momentum < 1:
            raise UserError(f"strategy.outer_momentum must be in [0, 1), got {self.outer_momentum}")
        if self.fragments < 1:
            raise UserError(f"strategy.fragments must be at least 1, got {self.fragments}")
        if self.fragments > self.sync_every:
            raise UserError(
                f"strategy.fragments ({self.fragments}) cannot exceed sync_every ({self.sync_every}): "
                "each fragment needs its own step in the round"
            )


@dataclass
class TimeoutConfig:
    """Every blocking distributed call has a time-out: generous while starting, short after."""

    rendezvous_s: float = 600.0  # all nodes join (slow SSH start, package imports on cold disks)
    startup_collective_s: float = 300.0  # first collectives (weight broadcast over a slow link)
    train_collective_s: float = 180.0  # once training runs: a dead peer is noticed this fast

    def validate(self) -> None:
        for name in ("rendezvous_s", "startup_collective_s", "train_collective_s"):
            if getattr(self, name) <= 0:
                raise UserError(f"timeouts.{name} must be positive")


@dataclass
class TrainConfig:
    preset: str = "tiny"
    data: str | None = None  # a text file or folder; None = the bundled corpus
    val_fraction: float = 0.05
    batch_size: int = 0  # sequences per rank per step; 0 = the preset's default
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 20
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    max_steps: int = 250  # the demo: ~75 s of training on 2 local ranks of an idle 2-core machine
    # The cosine schedule's horizon. 0 = max_steps of the first run: the CLI fixes it in the
    # stored config, so `--resume --max-steps N` extends a run without changing its schedule.
    lr_decay_steps: int = 0
    time_budget_s: float | None = None
    eval_every: int = 50
    eval_batches: int = 8
    checkpoint_every: int = 100
    keep_checkpoints: int = 3
    log_every: int = 1
    seed: int = 1337
    nodes: int = 2  # local worker processes when there is no cluster file
    nproc_per_node: int = 0  # 0 = one per GPU, else one
    threads_per_rank: int = 0  # 0 = the node's CPUs divided among its ranks
    cluster: str | None = None
    run_dir: str | None = None
    strategy: StrategyConfig = field(default_factory=StrategyConfig)
    timeouts: TimeoutConfig = field(default_factory=TimeoutConfig)

    def validate(self) -> None:
        from vpscluster.train.presets import get_preset

        shape = get_preset(self.preset)
        if self.max_steps < 1:
            raise UserError(f"max_steps must be at least 1, got {self.max_steps}")
        if self.batch_size < 0:
            raise UserError(f"batch_size must be positive, got {self.batch_size}")
        if self.time_budget_s is not None and self.time_budget_s <= 0:
            raise UserError(f"time_budget must be a positive number of seconds, got {self.time_budget_s}")
        if not 0 < self.val_fraction < 0.5:
            raise UserError(f"val_fraction must be between 0 and 0.5, got {self.val_fraction}")
        if self.lr <= 0:
            raise UserError(f"lr must be positive, got {self.lr}")
        for name in ("eval_every", "checkpoint_every", "log_every", "eval_batches", "keep_checkpoints"):
            if getattr(self, name) < 1:
                raise UserError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.lr_decay_steps < 0:
            raise UserError(f"lr_decay_steps must not be negative, got {self.lr_decay_steps}")
        if self.warmup_steps < 0:
            raise UserError(f"warmup_steps must not be negative, got {self.warmup_steps}")
        if self.nodes < 1:
            raise UserError(f"nodes must be at least 1, got {self.nodes}")
        cpus = os.cpu_count() or 1
        if self.cluster is None and self.nodes > max(8, 4 * cpus):
            raise UserError(
                f"--nodes {self.nodes} local processes on a machine with {cpus} CPUs would thrash; "
                f"use at most {max(8, 4 * cpus)} or a cluster file"
            )
        if not shape.trainable:
            raise UserError(
                f"preset {self.preset!r} is for planning only (too large to train here); "
                "use tiny or small, or run `vpscluster plan --model " + self.preset + "`"
            )
        if self.data is not None and not os.path.exists(self.data):
            raise UserError(f"--data {self.data}: no such file or folder")
        s = self.strategy
        if s.name not in ("ddp", "diloco", "auto"):
            from vpscluster.train.strategies import STRATEGIES

            if s.name not in STRATEGIES:
                raise UserError(f"unknown strategy {s.name!r}; choose one of: {', '.join(STRATEGIES)}, auto")
        if s.compress != "none" and s.name == "diloco":
            raise UserError("--compress applies to ddp; for diloco choose the pseudo-gradient's --wire-dtype")
        if s.name == "diloco" and self.checkpoint_every % s.sync_every:
            raise UserError(
                f"checkpoint_every ({self.checkpoint_every}) must be a multiple of sync_every "
                f"({s.sync_every}) so checkpoints fall on outer steps"
            )

    def decay_steps(self) -> int:
        return self.lr_decay_steps or self.max_steps

    def micro_batch(self) -> int:
        from vpscluster.train.presets import get_preset

        return self.batch_size or get_preset(self.preset).batch_size
