"""The session's settings: what `vpscluster run` resolved for a user's script, read by `session.start()`.

The launcher writes them, as JSON, into each node's run dir (`session.json`) and sets one
environment variable, `VPSC_SESSION`, to that file's path on the node (as `train` writes its
config.yaml for its workers). Without the variable (plain `python script.py`) the defaults hold:
one process, nothing to synchronise. Keys and rules are the training config's own: the strategy
is a `train.config.StrategyConfig`, the time-outs a `TimeoutConfig` (one source of settings).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated

from vpscluster import fsutil
from vpscluster.config import PYDANTIC_CONFIG, Before, Float, Int, build, flag, shorthand, to_dict
from vpscluster.errors import UserError
from vpscluster.train.config import StrategyConfig, TimeoutConfig, lift_launcher_keys
from vpscluster.train.strategies import COSTS, costs_for

ENV = "VPSC_SESSION"  # the path of this node's session.json, set by `vpscluster run`
FILE = "session.json"


@dataclass
class AutoInputs:
    """`--strategy auto`: what the launcher knows and the script does not — the ring's
    bottleneck bandwidth and per-hop latency (the probe's link matrix where `vpscluster probe`
    ran, else the cluster file's figures), each node's egress quota per rank — for the choice
    the session makes on its model and its first measured steps (`session/auto.py`)."""

    __pydantic_config__ = PYDANTIC_CONFIG

    bandwidth_bytes_s: Float
    latency_s: Float = 0.0
    egress_quotas: list[list[Float]] = field(default_factory=list)  # [bytes per rank, period seconds] per node
    source: str = ""  # where the link figures came from, for the reason line

    def __post_init__(self) -> None:
        if self.bandwidth_bytes_s <= 0 or self.latency_s < 0:
            raise UserError("auto.bandwidth_bytes_s must be positive and auto.latency_s >= 0; leave them to the launcher")
        if any(len(q) != 2 or min(q) <= 0 for q in self.egress_quotas):
            raise UserError("auto.egress_quotas needs [bytes per rank, period seconds] pairs; leave it to the launcher")


@dataclass
class SessionConfig:
    __pydantic_config__ = PYDANTIC_CONFIG

    strategy: Annotated[StrategyConfig, shorthand("name"), Before(lift_launcher_keys)] = field(default_factory=StrategyConfig)
    timeouts: TimeoutConfig = field(default_factory=TimeoutConfig)
    # stop, agreed at a sync point, after this much training time
    time_budget_s: Float | None = field(default=None, metadata=flag(
        "--time-budget", "stop every rank after the same step once this much training time is spent", "what",
        metavar="SECONDS", commands=("run",)))
    # torch threads per rank (OMP_NUM_THREADS on every node, and `session.start` sets it); 0: torch's
    # own choice, or on this machine (`--nodes N`) its CPUs divided among the ranks
    threads_per_rank: Int = field(default=0, metadata=flag(
        "--threads-per-rank", "torch threads per rank on every node (OMP_NUM_THREADS; default: torch's own, "
        "or with --nodes N this machine's CPUs divided among the ranks)", "what", metavar="N", commands=("run",)))
    seed: Int = 1337  # the data order of `Session.shard` (the same on every rank)
    # Where report.json, metrics.jsonl and checkpoints/ go on this node; None: nowhere (a plain
    # `python script.py` writes no files unless the script names a run dir).
    run_dir: str | None = None
    # steps between checkpoints `Session.step` saves; 0: only `Session.save`
    checkpoint_every: Int = field(default=0, metadata=flag(
        "--checkpoint-every", "the session saves a checkpoint every N steps (default: only where the script calls save)",
        "what", metavar="N", commands=("run",)))
    keep_checkpoints: Int = 3
    resume: bool = False  # `Session.resume` continues from the newest checkpoint in run_dir
    exporters: bool = False  # Prometheus metrics from every rank while training (train/exporter.py)
    auto: AutoInputs | None = None  # strategy auto: the launcher's link figures and quotas

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        if self.time_budget_s is not None and self.time_budget_s <= 0:
            raise UserError(f"time_budget must be a positive number of seconds, got {self.time_budget_s}")
        if self.checkpoint_every < 0 or self.keep_checkpoints < 1:
            raise UserError("checkpoint_every must be >= 0 (0 = only when the script saves) and keep_checkpoints >= 1")
        name = self.strategy.name
        if self.strategy.compress != "none" and name in COSTS and not costs_for(name).takes("compress"):
            raise UserError(f"--compress applies to ddp; for {name} choose the pseudo-gradient's --wire-dtype")
        if self.threads_per_rank < 0:
            raise UserError(f"threads_per_rank must not be negative (0 = automatic), got {self.threads_per_rank}")
        if not 0 <= self.seed < 2**32:
            raise UserError(f"seed must be between 0 and 2**32 - 1, got {self.seed}")


def write(cfg: SessionConfig, run_dir: str | Path) -> Path:
    return fsutil.write_json(Path(run_dir) / FILE, to_dict(cfg))


def read(path: str | Path) -> SessionConfig:
    import json

    p = Path(path)
    try:
        doc = json.loads(p.read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"{ENV}={p}: no readable session settings ({e}); start the script with `vpscluster run`, "
                        f"or unset {ENV}") from None
    return build(SessionConfig, doc, str(p))


def from_environment(**overrides) -> SessionConfig:
    """The launcher's settings (`VPSC_SESSION`), or the defaults; `overrides` (the script's own
    keyword arguments to `session.start`) win over both."""
    path = os.environ.get(ENV)
    cfg = read(path) if path else SessionConfig()
    if overrides:
        from vpscluster.config import merge

        cfg = build(SessionConfig, merge(to_dict(cfg), overrides), "session.start()")
    return cfg
