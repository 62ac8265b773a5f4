"""What a strategy costs and offers, asked without running it: its torch-free cost companion.

The planner (`plan/`), the launcher, the benches and the config's rules ask these questions of a
strategy *name* and its settings (a `StrategyConfig`), on the driver, where torch is not loaded:
how many bytes a sync puts on the wire, what a rank holds in memory, how many steps lie between
the points where the ranks meet, which settings mean something to it and which the plan picks.
Each strategy answers them in one companion module beside its own (`ddp_costs.py` beside
`ddp.py`), registered by name in `strategies/__init__.py: COSTS`; nothing outside the companions
branches on a strategy's name.

The time a sync takes depends on the cluster's links, which the planner models (`plan/comm.py`);
a companion receives that model as a `StepNetwork` and says how its collectives use it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, Protocol

if TYPE_CHECKING:
    from vpscluster.train.config import StrategyConfig

Traffic = list[tuple[str, float]]  # one sync's collectives: (allreduce | alltoall | allgather, buffer bytes)


class StepNetwork(Protocol):
    """The planner's network model for one step of the slowest rank (`plan/predict.py` builds it)."""

    world_size: int
    alpha_s: float  # the ring's per-step latency
    compute_s: float  # the slowest rank's compute of one step
    model: object  # `plan.shapes.ModelSpec`: num_params(), matrices(), shape

    def collectives_seconds(self, traffic: Traffic) -> float:
        """Wall time of these collectives, one after the other, on the best ring."""

    def overlapped_allreduce_seconds(self, grad_bytes_per_param: float, bucket_mb: float) -> tuple[float, float]:
        """(exposed, busy) seconds of gradients all-reduced in buckets while backward runs."""


class StrategyCosts:
    """The defaults fit a strategy that meets every step and keeps no state of its own."""

    name: ClassVar[str]
    # The StrategyConfig keys that mean something to this strategy: its flags, what its label
    # and the plan's JSON show, what a bench or config file sets for it.
    settings_keys: ClassVar[tuple[str, ...]] = ()
    # The keys the plan chooses where the user left them open (`launch/train.py` plans them
    # before a run; `train/replan.py` may change them mid-run). Empty: nothing is planned.
    planned_keys: ClassVar[tuple[str, ...]] = ()
    # May the weights, gradients and optimizer state be sharded across nodes (ZeRO, FSDP) to fit
    # memory? A strategy that replicates the whole model by design says no.
    shards_state: ClassVar[bool] = False
    # Bytes per parameter of the strategy's own state, kept in every checkpoint beside the
    # model's weights and optimizer.
    state_bytes_per_param: ClassVar[float] = 0.0
    # Uneven shares: is each of a rank's micro-batches an optimizer step of its own (True), or
    # are a step's micro-batches one accumulated gradient (False)? (`Strategy.micro_batches_are_steps`)
    micro_batches_are_steps: ClassVar[bool] = False
    # May the ranks take uneven shares of a step (`--micro-batches`, `train/shares.py`)?
    uneven_shares: ClassVar[bool] = True
    # A strategy that runs on the cluster's regions: (the strategy inside each region, the one
    # among the regions' leaders), e.g. ("ddp", "diloco"). The planner prices it on the regions
    # (`plan/hierarchical.py`) and the launcher gives it `launcher.node_regions`. None: one flat group.
    by_region: ClassVar[tuple[str, str] | None] = None

    def takes(self, key: str) -> bool:
        return key in self.settings_keys

    def steps_per_sync(self, s: "StrategyConfig") -> int:
        """Steps between the points where every rank meets (and a checkpoint may fall)."""
        return 1

    def is_plain(self, s: "StrategyConfig") -> bool:
        """Is this the plain baseline: the updates of one big machine, nothing compressed?"""
        return False

    def label(self, s: "StrategyConfig") -> str:
        return self.name

    def describe(self, s: "StrategyConfig") -> dict:
        """The settings that matter, as the plan's JSON shows them."""
        return {"name": self.name}

    def quality_risk(self, s: "StrategyConfig", total_steps: int | None = None) -> float:
        """0 = the same updates as one big machine; larger = further from it (heuristic scale)."""
        return 0.0

    def risk_on_regions(self, s: "StrategyConfig", total_steps: int | None, n_regions: int, world_size: int) -> float:
        """A strategy `by_region`: its quality risk with `n_regions` regions of `world_size` ranks."""
        return self.quality_risk(s, total_steps)

    def candidates(self, base: "StrategyConfig", world_size: int, sync_every_choices) -> list:
        """The settings `--strategy auto` weighs for this strategy, varied from `base`."""
        return []

    def representative(self, s: "StrategyConfig") -> bool:
        """Does the plan's candidate table show this one (the table stays readable)?"""
        return True

    def sync_traffic(self, s: "StrategyConfig", model, world_size: int) -> Traffic:
        """The collectives of one sync."""
        return []

    def memory_components(self, *, num_params: float, world_size: int, grad_bytes: float, sharding: str,
                          compress: str, wire_dtype: str, fragments: int) -> dict[str, float]:
        """Bytes one rank holds for the strategy beyond weights, gradients, optimizer, activations."""
        return {}

    def sync_compute_s(self, s: "StrategyConfig", sync_extra_s: dict[str, float]) -> float:
        """CPU seconds per step of the sync's own work (encode, decode, outer step), from the
        plan's measured figures per wire (`NodeResources.sync_extra_s`)."""
        return 0.0

    def exposed_seconds(self, s: "StrategyConfig", net: StepNetwork) -> tuple[float, float]:
        """(exposed, busy) seconds of communication per step on more than one rank."""
        busy = net.collectives_seconds(self.sync_traffic(s, net.model, net.world_size)) / self.steps_per_sync(s)
        return busy, busy
