"""The training configuration: one typed tree, built from defaults, `--config FILE.yaml`, then flags.

The classes are dataclasses whose field types pydantic checks when a configuration is built from
a mapping (`vpscluster.config.build`, used by `resolve` and `rundir.read_config`); each class's
`validate` holds the cross-field rules, in one place, and runs on every construction. Derived
values (the batch size a preset implies, the run directory) are computed by methods, never
stored twice. Strategy names come from the registry
(`train/strategies`), the compress and wire choices from `StrategyConfig`'s field types: the
CLI, the planner and the loader read them there (`strategy_choices`).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Annotated, Any, Literal, get_args

from vpscluster.config import PYDANTIC_CONFIG, Before, Float, Int, build, comma_floats, flag, load_yaml, merge, shorthand
from vpscluster.errors import UserError
from vpscluster.train.strategies import CHOICES, STRATEGIES, costs_for

StrategyName = Literal[CHOICES]  # the registry's names and "auto"
Compress = Literal["none", "bf16", "powersgd"]  # ddp: gradients on the wire
WireDtype = Literal["fp32", "bf16", "int8", "sparse2", "sparse4"]  # diloco: the pseudo-gradient on the wire (sparse: `strategies/sparse_wire.py`)


@dataclass
class ReplanInputs:
    """diloco: the sync rule's inputs other than the step time (`train/strategies/sync_rule.py: choose_sync`),
    written by the launcher with the plan. The ranks measure their real step in the first steps
    of each session and, where it is off the plan's `step_seconds` by more than
    `train/replan.py: TOLERANCE`, apply the rule again on the measured step (`train/replan.py`)."""

    __pydantic_config__ = PYDANTIC_CONFIG

    step_seconds: Float  # the plan's inner step (the slowest rank's compute)
    step_source: str  # where it came from: "measured" (plan --calibrate's step times) or "FLOP/s x efficiency"
    bandwidth_bytes_s: Float  # the ring's bottleneck
    latency_s: Float
    num_params: Float
    choices: list[Int]  # the H values allowed (dividing checkpoint_every, >= 4 outer steps)
    wires: list[WireDtype]  # most precise first
    keys: list[str]  # the rule's keys the user left open (only these may change)
    # Rule 6: each node's egress quota as [bytes per rank, period seconds], and the run's length
    # in inner steps and (with a time budget) seconds; 0 = not known.
    egress_quotas: list[list[Float]] = field(default_factory=list)
    run_steps: Int = 0
    run_seconds: Float = 0.0

    def __post_init__(self) -> None:
        if self.step_seconds <= 0 or self.bandwidth_bytes_s <= 0 or self.num_params <= 0 or not self.choices \
                or not self.wires:
            raise UserError("strategy.launcher.replan needs a positive step_seconds, bandwidth_bytes_s and num_params, "
                            "and at least one H and wire; leave it to the launcher")
        if any(len(q) != 2 or min(q) <= 0 for q in self.egress_quotas) or self.run_steps < 0 or self.run_seconds < 0:
            raise UserError("strategy.launcher.replan.egress_quotas needs [bytes per rank, period seconds] pairs, both "
                            "positive; leave it to the launcher")


# The launcher's keys, as runs made before `StrategyConfig.launcher` wrote them: flat in `strategy`.
LAUNCHER_KEYS = ("planned", "planned_reason", "replan", "node_speeds", "node_regions")


@dataclass
class LauncherChoices:
    """What the launcher wrote into the run's strategy settings: chosen from the plan or measured
    on the cluster when the run was launched, read by the ranks; never set by the user (a config
    file may hold it only as a run's stored config.yaml does)."""

    __pydantic_config__ = PYDANTIC_CONFIG

    # diloco: the strategy keys whose values the launcher chose from the plan
    # (`train/strategies/sync_rule.py`: every one of sync_every, wire_dtype, outer_lr,
    # outer_momentum, outer_warmup the user did not set), and its one-line reason; a record, kept
    # in the run's config and report.
    planned: list[str] = field(default_factory=list)
    planned_reason: str | None = None
    # diloco: the rule's inputs, for the ranks to apply it again on the step time they measure
    # (`train/replan.py`); set with `planned`, None = the plan stands as it is.
    replan: ReplanInputs | None = None
    # Per-rank speed of the ranks on each node, by node name, from the cluster's last probe: what
    # `train --balance` without `strategy.speeds` starts from; each rank looks up its node.
    node_speeds: dict[str, Float] | None = None
    # The region of each node, by node name (the cluster file's labels.region or the probe's
    # regions), for a strategy by regions without `strategy.regions`; each rank looks up its node.
    node_regions: dict[str, str] | None = None

    def __post_init__(self) -> None:
        if self.node_speeds is not None and (not self.node_speeds or any(v <= 0 for v in self.node_speeds.values())):
            raise UserError(f"strategy.launcher.node_speeds must map node names to positive numbers, got {self.node_speeds}")
        if self.node_regions is not None and not all(r for r in self.node_regions.values()):
            raise UserError(f"strategy.launcher.node_regions must map node names to region names, got {self.node_regions}")


def lift_launcher_keys(value: Any) -> Any:
    """A `strategy` mapping written before `launcher` existed (a run dir's config.yaml, so an
    older run still resumes): its flat launcher keys moved into `launcher`."""
    if not isinstance(value, dict) or not any(k in value for k in LAUNCHER_KEYS):
        return value
    out = {k: v for k, v in value.items() if k not in LAUNCHER_KEYS}
    launcher = out.get("launcher")
    out["launcher"] = {**(launcher if isinstance(launcher, dict) else {}),
                       **{k: value[k] for k in LAUNCHER_KEYS if k in value}}
    return out


@dataclass
class StrategyConfig:
    """How ranks keep their models in agreement (see `train/strategies/`)."""

    __pydantic_config__ = PYDANTIC_CONFIG

    name: StrategyName = field(default="ddp", metadata=flag(
        "--strategy", "ddp: all-reduce every step; diloco: sync every H steps; auto: let the planner choose (default {default})",
        "strategy", commands=("train", "run"), helps={"run": "ddp: all-reduce every step; diloco: sync every H steps; auto: the "
        "session times its first DDP steps and the sync rule chooses on them and the cluster's links (default {default})"}))
    # ddp: gradient compression through a DDP communication hook.
    compress: Compress = field(default="none", metadata=flag(
        "--compress", "ddp gradient compression on the wire (default {default})", "strategy", commands=("train", "run")))
    powersgd_rank: Int = field(default=4, metadata=flag(
        "--powersgd-rank", "rank of PowerSGD's low-rank factors (default {default})", "strategy", metavar="R"))
    # PowerSGD (Vogels et al., 2019) runs plain all-reduce for its first steps: DDP rebuilds its
    # buckets after step 1 and a short uncompressed warm-up protects accuracy. Must be >= 2.
    powersgd_start_step: Int = 10
    bucket_mb: Float = 25.0
    # diloco (Douillard et al., 2023): H inner steps, then an outer Nesterov-SGD step on the
    # token-weighted average pseudo-gradient.
    sync_every: Int = field(default=100, metadata=flag(
        "--sync-every", "diloco: inner steps between outer syncs (default: from the plan, see train/strategies/sync_rule.py)",
        "strategy", metavar="H", commands=("train", "run"),
        helps={"run": "diloco: inner steps between outer syncs (default {default})"}))
    outer_lr: Float = field(default=0.7, metadata=flag(
        "--outer-lr", "diloco: outer Nesterov learning rate (default {default}, the plan's)", "strategy"))
    outer_momentum: Float = field(default=0.9, metadata=flag(
        "--outer-momentum", "diloco: outer Nesterov momentum (default {default}, the plan's)", "strategy"))
    # diloco: outer syncs over which the outer step goes from plain averaging to Nesterov
    # (outer_lr, outer_momentum) (`strategies/diloco.py: outer_settings`); 0 = none.
    outer_warmup: Int = field(default=0, metadata=flag(
        "--outer-warmup", "diloco: outer syncs from plain averaging to the outer optimizer (default: about 100 steps' "
        "worth; 0 = none)", "strategy", metavar="SYNCS"))
    wire_dtype: WireDtype = field(default="fp32", metadata=flag(
        "--wire-dtype", "diloco: dtype of the pseudo-gradient on the wire (default: from the plan, fp32 on fast links, "
        "int8 on slow)", "strategy", commands=("train", "run"),
        helps={"run": "diloco: dtype of the pseudo-gradient on the wire (default {default})"}))
    # diloco: each replica's inner AdamW runs at lr x this. 0 = 1/sqrt(M), M the micro-batches of
    # a global step (one per rank unless --micro-batches): `lr` is set for the global batch, as
    # for ddp, and a replica steps on 1/M of it (`strategies/diloco.py: inner_lr_scale`).
    inner_lr_scale: Float = field(default=0.0, metadata=flag(
        "--inner-lr-scale", "diloco: each replica's AdamW runs at lr times X (default: 1/sqrt(replicas), as each steps "
        "on 1/M of the global batch that --lr is set for)", "strategy", metavar="X"))
    # diloco: each outer sync's collectives time out after this (0 = the run's training time-out)
    # and are retried this many times on a fresh process group before the round is skipped.
    sync_timeout_s: Float = 0.0
    sync_retries: Int = 1
    # diloco: every rank logs the sha256 of the global weights after each outer update ("diloco
    # sync: ..." lines in each node's log), so replicas can be compared sync by sync, e.g. after
    # faults (`bench faults`). One pass over the weights per sync; off by default.
    sync_hashes: bool = False
    # Streaming DiLoCo (Douillard et al., 2025): the model split into this many fragments, each
    # synced at a staggered step, so traffic is spread over the round. 1 = no streaming.
    fragments: Int = field(default=1, metadata=flag(
        "--fragments", "streaming diloco: fragments synced at staggered steps (default {default})", "strategy",
        metavar="N"))
    # Overlapped outer sync (Streaming DiLoCo, Douillard et al. 2025): a fragment's all-reduce
    # runs in the background while the next `overlap_steps` inner steps compute; its outer update
    # is applied that many steps late, merged with the local progress made meanwhile. 0 = the
    # blocking sync. Capped at H - 1 (a fragment is never sent again before its update lands).
    overlap_steps: Int = field(default=1, metadata=flag(
        "--overlap-steps", "diloco: inner steps computed while an outer sync is on the wire; its update lands TAU steps "
        "late (default {default}, capped at H-1; 0 = blocking)", "strategy", metavar="TAU", commands=("train", "run")))
    # Uneven nodes (`train/shares.py`). A step's global batch is `micro_batches` micro-batches
    # of batch_size sequences, split among the ranks (0 = one per rank: the classic even split).
    # ddp: a rank accumulates its share (no_sync for all but the last); diloco: each of its
    # micro-batches is one inner step. `speeds`: relative speed per rank to start from (the
    # probe's or plan's figures; none = even). `balance`: re-measure every `rebalance_every`
    # steps and re-split. `min_share`: micro-batches every rank keeps (0 allowed: such a rank
    # still joins every collective). `max_spread`: speeds are clamped to at least
    # max(speeds) / max_spread (0 = no rule). Without `speeds`, `train --balance` starts from
    # the launcher's `launcher.node_speeds` (`speeds`, per rank, wins).
    # `balance` None (the default): the launcher decides (`launch/balance.py`: on, with a split it
    # chooses, when the probe shows ranks more than 15% apart; else False); --no-balance: False.
    micro_batches: Int = field(default=0, metadata=flag(
        "--micro-batches", "micro-batches of --batch-size sequences per step in all, split among the ranks by speed "
        "(default: one per rank)", "uneven", metavar="N", commands=("train", "run"),
        helps={"run": "shares per step in all, split among the ranks by --speeds (default: one per rank): ddp cuts "
               "each step's world x B samples into them, diloco runs each as an inner step of the script's batch B, "
               "auto starts as ddp and carries them over if it switches to diloco"}))
    balance: bool | None = field(default=None, metadata=flag(
        "--balance", "measure each rank's speed as it trains and re-split the micro-batches when it changes (default: "
        "on, with a split chosen from the probe, when the nodes' speeds differ by more than 15%%; --no-balance: the "
        "even split, every rank waits for the slowest)", "uneven", negatable=True, commands=("train", "run"),
        helps={"run": "uneven shares re-split from the measured speeds (default on a cluster whose probe shows nodes "
               "of different CPUs or GPUs: ddp and auto give the faster nodes larger batches, diloco (and auto once "
               "it switches to diloco) more inner steps of the script's batch; "
               "--no-balance: the even split, every rank waits for the slowest)"}))
    speeds: list[Float] | None = field(default=None, metadata=flag(
        "--speeds", "relative speed of each rank to start from (e.g. 3,1; default with --balance: the cluster's last "
        "probe, else even)", "uneven", metavar="S,S,...", parse=comma_floats, commands=("train", "run"),
        helps={"run": "relative speed of each rank (e.g. 3,1): the faster reads more micro-batches per step"}))
    min_share: Int = field(default=1, metadata=flag(
        "--min-share", "micro-batches every rank keeps (default {default})", "uneven", metavar="N"))
    max_spread: Float = field(default=8.0, metadata=flag(
        "--max-spread", "treat no rank as more than X times slower than the fastest (default {default:g}; 0 = no bound)",
        "uneven", metavar="X"))
    rebalance_every: Int = field(default=5, metadata=flag(
        "--rebalance-every", "steps between speed measurements (default {default})", "uneven", metavar="K"))
    # hierarchical (`strategies/hierarchical.py`): the region of each rank, by rank (e.g.
    # [fra, fra, lax, lax]); without it, each rank looks up its node in the launcher's
    # `launcher.node_regions`. Ranks of a region all-reduce gradients every step; the regions
    # meet in a DiLoCo outer sync every sync_every steps.
    regions: list[str] | None = None
    # diloco on a quorum (torchft's Manager, `strategies/quorum_diloco.py`): each replica group
    # (a node) trains on whoever is present; a dead one is dropped at the next sync, a returning
    # or new one heals from a peer. The outer syncs wait for at least `quorum_min_replicas`
    # replica groups, and a quorum not formed within `quorum_timeout_s` ends the replica (the
    # relaunch path takes over).
    quorum: bool = field(default=False, metadata=flag(
        "--quorum", "diloco on torchft's per-step quorum: a lighthouse on the head, one replica group per node with its "
        "own rendezvous; a node that dies is left out at the next sync and the others train on without a relaunch "
        "(needs torchft 0.2.0 on the nodes; default off)", "strategy", negatable=True, commands=("train", "run"),
        helps={"run": "diloco on torchft's per-step quorum: a lighthouse on the head, one replica group per node with "
               "its own rendezvous; a node that dies is left out at the next sync and the others train on without a "
               "relaunch (needs a cluster file, a script on the session API and torchft 0.2.0 on the nodes; default off)"}))
    quorum_min_replicas: Int = 2
    quorum_timeout_s: Float = 60.0
    # What the launcher chose and measured for this run (never the user's settings).
    launcher: LauncherChoices = field(default_factory=LauncherChoices)

    def __post_init__(self) -> None:
        self.validate()

    def with_launcher(self, **changes: Any) -> "StrategyConfig":
        """A copy with these `launcher` fields changed (e.g. planned=[], replan=None)."""
        return dataclasses.replace(self, launcher=dataclasses.replace(self.launcher, **changes))

    def validate(self) -> None:
        if self.sync_timeout_s < 0 or self.sync_retries < 0:
            raise UserError(f"strategy.sync_timeout_s and sync_retries must be >= 0, got {self.sync_timeout_s:g} and {self.sync_retries}")
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
        if self.inner_lr_scale < 0:
            raise UserError(f"strategy.inner_lr_scale must not be negative (0 = 1/sqrt(replicas)), got {self.inner_lr_scale:g}")
        if self.outer_warmup < 0:
            raise UserError(f"strategy.outer_warmup must not be negative (0 = none), got {self.outer_warmup}")
        if self.fragments < 1:
            raise UserError(f"strategy.fragments must be at least 1, got {self.fragments}")
        if self.overlap_steps < 0:
            raise UserError(f"strategy.overlap_steps must be >= 0 (0 = blocking outer sync), got {self.overlap_steps}")
        if self.fragments > self.sync_every:
            raise UserError(
                f"strategy.fragments ({self.fragments}) cannot exceed sync_every ({self.sync_every}): "
                "each fragment needs its own step in the round"
            )
        if self.micro_batches < 0:
            raise UserError(f"strategy.micro_batches must not be negative (0 = one per rank), got {self.micro_batches}")
        if self.min_share < 0:
            raise UserError(f"strategy.min_share must not be negative, got {self.min_share}")
        if self.max_spread < 0 or 0 < self.max_spread < 1:
            raise UserError(f"strategy.max_spread must be 0 (no rule) or at least 1, got {self.max_spread}")
        if self.rebalance_every < 1:
            raise UserError(f"strategy.rebalance_every must be at least 1, got {self.rebalance_every}")
        if self.speeds is not None and (not self.speeds or any(v <= 0 for v in self.speeds)):
            raise UserError(f"strategy.speeds must be positive numbers, one per rank, got {self.speeds}")
        if self.regions is not None and (not self.regions or not all(isinstance(r, str) and r for r in self.regions)):
            raise UserError(f"strategy.regions must name the region of each rank, got {self.regions}")
        if self.micro_batches and self.name in STRATEGIES and not costs_for(self.name).uneven_shares:
            raise UserError(f"uneven shares (--micro-batches) are not supported by --strategy {self.name} yet; "
                            "leave them out or use --strategy diloco")
        if self.quorum:
            self._validate_quorum()
        if (self.balance or self.speeds is not None) and self.micro_batches == 0:
            raise UserError(
                "--balance or --speeds needs --micro-batches N (micro-batches per step in all, at least one per "
                "rank); or give none of them: train balances by default when the probe shows uneven nodes"
            )

    def _validate_quorum(self) -> None:
        from vpscluster.train.strategies import QUORUM_ENGINES

        if self.name not in QUORUM_ENGINES:
            raise UserError(f"strategy.quorum needs --strategy {' or '.join(QUORUM_ENGINES)} for now (got {self.name}); "
                            f"leave quorum off for {self.name}")
        if self.fragments != 1 or self.micro_batches or self.wire_dtype.startswith("sparse"):
            raise UserError("strategy.quorum runs whole-model syncs on an fp32, bf16 or int8 wire: leave fragments at 1, "
                            "micro_batches at 0 and choose a dense wire_dtype")
        if self.quorum_min_replicas < 1 or self.quorum_timeout_s <= 0:
            raise UserError(f"strategy.quorum_min_replicas must be >= 1 and quorum_timeout_s positive, got "
                            f"{self.quorum_min_replicas} and {self.quorum_timeout_s:g}")


@dataclass
class TimeoutConfig:
    """Every blocking distributed call has a time-out: generous while starting, short after."""

    __pydantic_config__ = PYDANTIC_CONFIG

    rendezvous_s: Float = 600.0  # all nodes join (slow SSH start, package imports on cold disks)
    startup_collective_s: Float = 300.0  # first collectives (weight broadcast over a slow link)
    # once training runs: a dead peer is noticed this fast
    train_collective_s: Float = field(default=180.0, metadata=flag(
        "--collective-timeout", "once training runs, a collective waiting this long fails: how fast a dead peer is "
        "noticed (default {default:g})", "timeouts", metavar="SECONDS", commands=("run",)))
    # A stopped run (Ctrl-C, SIGTERM, `vpscluster stop`, a launcher gone): its workers save a
    # checkpoint at the next step boundary within this, else they are killed.
    stop_grace_s: Float = 30.0

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        for name in ("rendezvous_s", "startup_collective_s", "train_collective_s", "stop_grace_s"):
            if getattr(self, name) <= 0:
                raise UserError(f"timeouts.{name} must be positive")


@dataclass
class RecoveryConfig:
    """Going on after a failure without a person (launch/recovery.py)."""

    __pydantic_config__ = PYDANTIC_CONFIG

    # Relaunches from the last checkpoint after a failure (0: the first failure ends the run;
    # None: the default, `launch/recovery.py` `policy`: on for a cluster of two or more nodes).
    max_restarts: Int | None = field(default=None, metadata=flag(
        "--max-restarts", "after a failure, relaunch from the last checkpoint on the nodes that answer, up to N times "
        "(default on a cluster of two or more nodes: twice the node count, at least {min_restarts}; on this machine's "
        "local cluster: 0. 0 turns recovery off: the first failure ends the run)", "where", metavar="N",
        commands=("train", "run"), resume=True,
        helps={"run": "after a failure, relaunch the script on the nodes that answer, up to N times; its session "
               "resumes from its newest checkpoint (default on a cluster of two or more nodes: twice the node count, "
               "at least {min_restarts}; with --nodes: 0. 0 turns recovery off)"}))
    # The fewest nodes the run goes on with when some stop answering (0: the default, half the
    # nodes rounded up, `recovery.default_min_nodes`).
    min_nodes: Int = field(default=0, metadata=flag(
        "--min-nodes", "go on with at least N nodes when some stop answering; a node that answers again takes part "
        "again (default: half the nodes, rounded up; each node holds a whole replica, so fewer nodes need no more "
        "memory per node)", "where", metavar="N", commands=("train", "run"), resume=True,
        helps={"run": "go on with at least N nodes when some stop answering; a node that answers again takes part "
               "again (default: half the nodes, rounded up)"}))
    # While a node is out, how often the launcher looks whether it answers again (it then takes
    # part again: the run stops at a checkpoint and relaunches with it).
    rejoin_poll_s: Float = 10.0

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        if (self.max_restarts or 0) < 0 or self.min_nodes < 0:
            raise UserError(f"recovery.max_restarts and min_nodes must not be negative, got "
                            f"{self.max_restarts} and {self.min_nodes}")
        if self.rejoin_poll_s <= 0:
            raise UserError("recovery.rejoin_poll_s must be positive")


@dataclass
class TrainConfig:
    __pydantic_config__ = PYDANTIC_CONFIG

    preset: str = field(default="tiny", metadata=flag(
        "--preset", "model shape: tiny (~1M), small (~10M); bigger ones are for `plan` (default {default})", "what",
        metavar="NAME"))
    # a text file or folder; None = the bundled corpus
    data: str | None = field(default=None, metadata=flag(
        "--data", "a text file or a folder of text files (default: the bundled King James Bible)", "what", metavar="PATH"))
    val_fraction: Float = 0.05
    # sequences per rank per step; 0 = the preset's default
    batch_size: Int = field(default=0, metadata=flag(
        "--batch-size", "sequences per rank per step (default: the preset's)", "what", metavar="N"))
    # peak learning rate; 0 = the preset's default (`presets.preset_lr`)
    lr: Float = field(default=0.0, metadata=flag(
        "--lr", "peak learning rate (default: the preset's, {preset_lrs}; {root.warmup_steps} warm-up steps, then "
        "cosine decay)", "what"))
    min_lr_ratio: Float = 0.1
    warmup_steps: Int = 20
    weight_decay: Float = 0.1
    grad_clip: Float = 1.0
    # the demo: ~75 s of training on 2 local ranks of an idle 2-core machine
    max_steps: Int = field(default=250, metadata=flag(
        "--max-steps", "optimizer steps to train (default {default})", "what", metavar="N", resume=True))
    # The cosine schedule's horizon. 0 = max_steps of the first run: the CLI fixes it in the
    # stored config, so `--resume --max-steps N` extends a run without changing its schedule.
    lr_decay_steps: Int = 0
    time_budget_s: Float | None = field(default=None, metadata=flag(
        "--time-budget", "stop cleanly, with a checkpoint, after this much training time (per session)", "what",
        metavar="SECONDS", resume=True))
    eval_every: Int = field(default=50, metadata=flag(
        "--eval-every", "validation loss every N steps (default {default})", "what", metavar="N"))
    eval_batches: Int = 8
    checkpoint_every: Int = field(default=100, metadata=flag(
        "--checkpoint-every", "checkpoint every N steps (default {default}; always one at the end)", "what", metavar="N"))
    keep_checkpoints: Int = 3
    log_every: Int = 1
    seed: Int = field(default=1337, metadata=flag(
        "--seed", "seed for weights and data order (default {default})", "what"))
    # local worker processes when there is no cluster file
    nodes: Int = field(default=2, metadata=flag(
        "--nodes", "number of local worker processes when there is no cluster file (default {default})", "where_one",
        metavar="N", resume=True))
    # 0 = one per GPU, else one
    nproc_per_node: Int = field(default=0, metadata=flag(
        "--nproc-per-node", "ranks per cluster node (default: one per GPU, else one)", "where", metavar="N", resume=True))
    # 0 = the node's CPUs divided among its ranks
    threads_per_rank: Int = field(default=0, metadata=flag(
        "--threads-per-rank", "torch threads per rank (default: the CPUs the node really grants, cgroup quota included, "
        "divided among its ranks)", "where", metavar="N"))
    # Prometheus metrics from every rank and node while training (telemetry.py)
    exporters: bool = field(default=True, metadata=flag(
        "--no-exporters", "serve no Prometheus metrics from the ranks and nodes (see `vpscluster monitor`)", "run",
        store_false=True))
    cluster: str | None = field(default=None, metadata=flag(
        "--cluster", "cluster.yaml: train across its nodes over SSH (default: this machine)", "where_one",
        metavar="FILE", resume=True))
    run_dir: str | None = field(default=None, metadata=flag(
        "--run-dir", "where the run is written (default runs/<UTC time>-<random>)", "run", metavar="DIR"))
    # Set when the run is created (random, kept by --resume): the run's folder on the nodes is
    # runs/<run dir's name>-<run_uid> (`rundir.node_name`), so a new run whose folder has an older
    # run's name never picks up that run's checkpoints there. Empty in runs made before it.
    run_uid: str = ""
    # `strategy: diloco` is what users write; it means `strategy: {name: diloco}`.
    strategy: Annotated[StrategyConfig, shorthand("name"), Before(lift_launcher_keys)] = field(default_factory=StrategyConfig)
    timeouts: TimeoutConfig = field(default_factory=TimeoutConfig)
    recovery: RecoveryConfig = field(default_factory=RecoveryConfig)

    def __post_init__(self) -> None:
        self.validate(outer_steps=False)  # DiLoCo's H may still be planned (launch/train.py checks after)

    def validate(self, outer_steps: bool = True) -> None:
        """Refuse impossible settings in one line. `outer_steps`: also that DiLoCo checkpoints fall
        on outer steps (checkpoint_every a multiple of H); false until the planner has set H."""
        from vpscluster.train.presets import get_preset

        shape = get_preset(self.preset)
        if self.max_steps < 1:
            raise UserError(f"max_steps must be at least 1, got {self.max_steps}")
        if self.strategy.quorum and not self.cluster:
            raise UserError("--quorum trains one replica group per node of a cluster file: give --cluster FILE "
                            "(the local cluster runs every rank in one group), or leave --quorum out")
        if self.strategy.quorum and self.nproc_per_node > 1:
            raise UserError(f"--quorum runs one rank per node for now (its replica group); drop --nproc-per-node "
                            f"{self.nproc_per_node} or leave --quorum out")
        if self.batch_size < 0:
            raise UserError(f"batch_size must be positive, got {self.batch_size}")
        if self.time_budget_s is not None and self.time_budget_s <= 0:
            raise UserError(f"time_budget must be a positive number of seconds, got {self.time_budget_s}")
        if not 0 < self.val_fraction < 0.5:
            raise UserError(f"val_fraction must be between 0 and 0.5, got {self.val_fraction}")
        if self.lr < 0:
            raise UserError(f"lr must be positive (0 = the preset's default), got {self.lr}")
        for name in ("eval_every", "checkpoint_every", "log_every", "eval_batches", "keep_checkpoints"):
            if getattr(self, name) < 1:
                raise UserError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.lr_decay_steps < 0:
            raise UserError(f"lr_decay_steps must not be negative, got {self.lr_decay_steps}")
        if self.warmup_steps < 0:
            raise UserError(f"warmup_steps must not be negative, got {self.warmup_steps}")
        if self.nodes < 1:
            raise UserError(f"nodes must be at least 1, got {self.nodes}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise UserError(f"min_lr_ratio must be between 0 and 1, got {self.min_lr_ratio}")
        if self.weight_decay < 0:
            raise UserError(f"weight_decay must not be negative, got {self.weight_decay}")
        if self.grad_clip <= 0:
            raise UserError(f"grad_clip must be positive, got {self.grad_clip}")
        for name in ("nproc_per_node", "threads_per_rank"):
            if getattr(self, name) < 0:
                raise UserError(f"{name} must not be negative (0 = automatic), got {getattr(self, name)}")
        if not 0 <= self.seed < 2**32:
            raise UserError(f"seed must be between 0 and 2**32 - 1, got {self.seed}")
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
        if s.name not in CHOICES:  # a name assigned after construction (e.g. by the planner)
            raise UserError(f"unknown strategy {s.name!r}; choose one of: {', '.join(CHOICES)}")
        if s.compress != "none" and s.name in STRATEGIES and not costs_for(s.name).takes("compress"):
            raise UserError(f"--compress applies to ddp; for {s.name} choose the pseudo-gradient's --wire-dtype")
        if s.micro_batches and self.cluster is None:
            # nproc_per_node 0 = one per GPU: at least one per node (the trainer checks the rest).
            world = self.nodes * max(1, self.nproc_per_node)
            if s.speeds is not None and len(s.speeds) != world and self.nproc_per_node:
                raise UserError(f"strategy.speeds has {len(s.speeds)} entries for {world} ranks; give one per rank")
            if s.micro_batches < s.min_share * world:
                raise UserError(
                    f"--micro-batches {s.micro_batches} cannot give each of {world} ranks at least "
                    f"{s.min_share}; use at least {s.min_share * world} or lower strategy.min_share"
                )
        if outer_steps and s.name in STRATEGIES and self.checkpoint_every % costs_for(s.name).steps_per_sync(s):
            raise UserError(
                f"checkpoint_every ({self.checkpoint_every}) must be a multiple of sync_every "
                f"({s.sync_every}) so checkpoints fall on outer steps"
            )

    def decay_steps(self) -> int:
        return self.lr_decay_steps or self.max_steps

    def peak_lr(self) -> float:
        from vpscluster.train.presets import preset_lr

        return self.lr or preset_lr(self.preset)

    def micro_batch(self) -> int:
        from vpscluster.train.presets import get_preset

        return self.batch_size or get_preset(self.preset).batch_size


def strategy_choices(key: str) -> tuple[str, ...]:
    """The values `strategy.<key>` accepts, read from StrategyConfig's field type (e.g. "compress")."""
    tp = next(f.type for f in fields(StrategyConfig) if f.name == key)
    return get_args(globals()[tp] if isinstance(tp, str) else tp)


def config_keys() -> str:
    """The keys a config file takes, for help texts (read from the classes, never copied)."""
    groups = (("strategy", StrategyConfig), ("timeouts", TimeoutConfig), ("recovery", RecoveryConfig))
    top = [f.name for f in fields(TrainConfig) if f.name not in dict(groups) and f.name != "run_uid"]  # set at creation
    nested = {n: [f.name for f in fields(c) if f.name != "launcher"] for n, c in groups}  # written by the launcher
    return ", ".join(top) + "; " + "; ".join(f"{n}: {{{', '.join(v)}}}" for n, v in nested.items())


def resolve(config_file: str | Path | None = None, overrides: dict[str, Any] | None = None) -> TrainConfig:
    """The TrainConfig for a new run: defaults < `config_file` (YAML) < `overrides` (nested mapping).

    Only reads: nothing is created, so a refused configuration leaves nothing behind. Problems
    with the file's keys and types name the file; rules across keys are checked once the
    overrides are applied (a flag may fix what the file alone gets wrong).
    """
    mapping: dict[str, Any] = {}
    file_rule: UserError | None = None
    where = str(config_file)
    if config_file is not None:
        mapping = load_yaml(config_file, "--config")
        try:
            build(TrainConfig, mapping, where)
        except UserError as e:
            if str(e).startswith(where + ": "):  # a key or type problem in the file itself
                raise
            file_rule = e  # a rule across keys: a flag may still fix it
        if isinstance(mapping.get("strategy"), str):
            mapping = {**mapping, "strategy": {"name": mapping["strategy"]}}  # so flags merge into it
    try:
        return build(TrainConfig, merge(mapping, overrides or {}), "flags")
    except UserError as e:
        if file_rule is not None and str(e) == str(file_rule):
            raise UserError(f"{where}: {e}") from None  # the file's values break it, not the flags
        raise
