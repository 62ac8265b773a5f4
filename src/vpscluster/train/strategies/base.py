"""The strategy interface: how ranks keep their models in agreement.

The training loop never branches on the strategy. It calls, per step:

    with strategy.no_sync(accumulating):   # micro-batches that should not communicate yet
        loss = model(x, y); loss.backward()
    strategy.step(optimizer, step)         # optimizer step plus whatever sync the strategy does
    seconds, nbytes = strategy.comm.take() # communication spent since the last take()

and `strategy.finalize(last_step)` once at the end, before the final validation and checkpoint.
With a time budget the loop asks `strategy.is_sync_point(step)` after each step and agrees on
stopping (a one-integer all-reduce) only at those steps: where the ranks wait for each other
anyway (ddp: every step; diloco: the steps an outer update lands), never a collective of its own
in between.

and `strategy.setup(model)` once, before the optimizer is built from the module it returns.
Each strategy is one file under `train/strategies/`:

- `ddp`: DistributedDataParallel; gradients all-reduced every step, optionally compressed
  through a DDP communication hook (bf16, PowerSGD).
- `diloco`: local inner steps, an outer step on averaged pseudo-gradients every H steps.
- a vertical (feature-wise) split would return a model whose layers are sharded by feature
  across ranks (`setup`), read the same batch on every rank (`data_shard`), and report the
  activations it exchanges through the same `comm` counters.

Communication is *measured*: a strategy times the collectives it issues (wall time spent waiting
for them on this rank) and counts the bytes this rank puts on the wire for each one, using the
collective's algorithm (ring all-reduce sends 2(n-1)/n of the buffer per rank).
"""

from __future__ import annotations

import contextlib
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Iterator

if TYPE_CHECKING:
    import torch
    from torch import nn

    from vpscluster.train.config import StrategyConfig
    from vpscluster.train.strategies.costs import StrategyCosts


@dataclass
class DistContext:
    """Where this process sits in the job."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    backend: str = "gloo"
    device: Any = "cpu"  # torch.device
    # The process group of the job (the default one), or None without one. It starts with the
    # long `timeouts.startup_collective_s`; `session/dist.py: end_startup` lowers it to the short
    # `timeouts.train_collective_s` once start-up is over, so a dead peer is noticed fast.
    group: Any = None

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1


@dataclass
class CommStats:
    """Seconds and bytes this rank spent communicating; thread-safe (hooks run on DDP's threads)."""

    seconds: float = 0.0
    bytes_sent: int = 0
    total_seconds: float = 0.0
    total_bytes_sent: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, seconds: float, nbytes: int) -> None:
        with self._lock:
            self.seconds += seconds
            self.bytes_sent += int(nbytes)
            self.total_seconds += seconds
            self.total_bytes_sent += int(nbytes)

    @contextlib.contextmanager
    def timed(self, nbytes: int) -> Iterator[None]:
        """Time a blocking collective and count `nbytes` sent by this rank."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.add(time.perf_counter() - t0, nbytes)

    def take(self) -> tuple[float, int]:
        """Return (seconds, bytes) since the last take and reset the per-step counters."""
        with self._lock:
            out = (self.seconds, self.bytes_sent)
            self.seconds, self.bytes_sent = 0.0, 0
            return out


def ring_allreduce_bytes(nbytes: int, world_size: int) -> int:
    """Bytes one rank sends in a ring all-reduce of an `nbytes` buffer (reduce-scatter + all-gather)."""
    if world_size <= 1:
        return 0
    return int(2 * (world_size - 1) * nbytes / world_size)


class Strategy(ABC):
    """One way of synchronising ranks. Subclasses register a `name` in `strategies/__init__.py`."""

    name: ClassVar[str]

    def __init__(self, config: "StrategyConfig", ctx: DistContext) -> None:
        self.config = config
        self.ctx = ctx
        self.comm = CommStats()

    # What the strategy costs and offers, without torch: its companion (`costs.py`), so the
    # running strategy and the planner answer from one place.
    @property
    def costs(self) -> "StrategyCosts":
        from vpscluster.train.strategies import costs_for

        return costs_for(self.name)

    @property
    def micro_batches_are_steps(self) -> bool:
        """Uneven shares (`--micro-batches`): False = a rank's micro-batches of a step are one
        gradient (accumulated, synchronised once: ddp); True = each is an inner optimizer step of
        its own, only the last goes through `step` (diloco)."""
        return self.costs.micro_batches_are_steps

    def steps_per_sync(self) -> int:
        """Steps between the points where every rank meets (ddp: 1; diloco: H)."""
        return self.costs.steps_per_sync(self.config)

    @abstractmethod
    def setup(self, model: "nn.Module") -> "nn.Module":
        """Wrap `model` (already on ctx.device, identical on every rank); return the module to train."""

    def no_sync(self, accumulating: bool) -> contextlib.AbstractContextManager:
        """Context for a backward pass that must not communicate yet (gradient accumulation)."""
        return contextlib.nullcontext()

    def step(self, optimizer: "torch.optim.Optimizer", step: int) -> None:
        """Apply this step's update (and any synchronisation). `step` counts from 1."""
        optimizer.step()

    def is_sync_point(self, step: int) -> bool:
        """Do the ranks wait for each other at the end of `step` anyway? Only there does the loop
        agree on a time-budget stop. Default: every step (ddp all-reduces every step; its
        agreement stays a separate one-integer all-reduce right after the gradients')."""
        return True

    def lr_scale(self) -> float:
        """Factor on the schedule's lr for this rank's optimizer. Default 1: the optimizer steps
        on the global batch (ddp)."""
        return 1.0

    def join(self, position: "Callable[[], dict]") -> None:
        """Called once after `setup` (after `resume` when the run resumes), before the loop. A
        quorum engine forms its first quorum here; `position()` is the loop's place (`steps`,
        `data`) that a replica joining later takes from this one. Default: nothing to join."""

    def moved_to(self) -> dict | None:
        """The loop's place (`steps`, `data`) this replica took from a peer it healed from since
        the last call (a quorum engine: at `join`, or at a round's first step), else None. The
        loop goes on from there."""
        return None

    def left(self) -> bool:
        """Has this replica left the job on request (a quorum engine's drain: it took part in its
        last outer sync and the others go on without it)? The loop then stops, like a stop. Default: never."""
        return False

    def finalize(self, step: int) -> None:
        """Called once after the last step, on every rank (DiLoCo: a last outer sync mid-round)."""

    def data_shard(self) -> tuple[int, int]:
        """(shard index, number of shards) this rank reads: data-parallel by default."""
        return self.ctx.rank, self.ctx.world_size

    def unwrap(self) -> "nn.Module":
        """The plain model whose weights are checkpointed, hashed and evaluated."""
        raise NotImplementedError(f"{type(self).__name__}.unwrap")

    def eval_point(self, step: int) -> bool:
        """May validation run at the end of `step`? Every rank takes part (the batches are split
        among them and the losses gathered), so it runs where the ranks meet anyway. Default:
        every step (ddp meets at every step)."""
        return True

    @contextlib.contextmanager
    def eval_weights(self) -> "Iterator[nn.Module]":
        """The module validation runs on, holding weights that are the same on every rank (ddp:
        the model as it is)."""
        yield self.unwrap()

    def weigh_batch(self, weight: float) -> None:
        """Uneven batches in one gradient (a ddp session's shares, `session/shard.py`): this
        rank's gradient counts `weight` (world * its batch / the step's samples) times in the
        average. Only strategies that average gradients every step take it; one whose
        micro-batches are steps of their own weighs by `tokens_processed` instead."""
        raise NotImplementedError(f"{type(self).__name__} does not weigh uneven batches")

    def tokens_processed(self, tokens: int) -> None:
        """The loop reports the tokens this rank trained on this step (DiLoCo weights by them)."""

    def state_dict(self) -> dict[str, Any]:
        """Strategy state a checkpoint must keep (DiLoCo: global weights, outer momentum)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state:
            raise ValueError(f"strategy {self.name!r} has no state to load, got keys {sorted(state)}")

    def reshard_state(self, state: dict[str, Any]) -> dict[str, Any]:
        """A checkpoint's state (this rank's shard, taken with another number of ranks) made
        loadable in this world. Rank-local state that stays valid is kept as it is."""
        return state

    def describe(self) -> dict[str, Any]:
        """Settings that matter for the report (e.g. compression, H)."""
        return {"name": self.name}

    def replica_sha256(self) -> str:
        """A sha256 of the state every rank must hold alike at a checkpoint (ddp: the model's
        weights; diloco: the global weights and outer momentum, its replicas differ mid-round).
        The loop compares it across ranks before every checkpoint (`Session.save`)."""
        from vpscluster.train.checkpoint import state_hash

        return state_hash(self.unwrap().state_dict())

    def collective_groups(self) -> list:
        """Process groups of the strategy's own whose time-out follows the loop's collectives
        (`session/dist.py: end_startup` lowers it with the default group's). Default: none."""
        return []

    def close(self) -> None:
        """Release hooks and threads."""
