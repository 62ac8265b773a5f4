"""`hierarchical`: DDP inside a region every step, DiLoCo across regions every H steps.

Real fleets are islands of nearby machines (fast links) joined by slow long-distance links. Here
the ranks of a region are one replica: their gradients are all-reduced every step by
DistributedDataParallel on the region's process group (`ddp.py`, compression hooks included),
so they hold identical weights after every step. The regions are DiLoCo's replicas (`diloco.py`,
Douillard et al., 2023, arXiv:2311.08105): every H steps their pseudo-gradients are averaged,
weighted by tokens, and one outer Nesterov step is taken. DiLoCo with R regions of L ranks is
DiLoCo with R replicas of L times the batch: fewer, larger replicas learn more per token than
R·L small ones (Charles et al., 2025: fewer replicas cost less at equal tokens).

Who crosses the slow links. Each region's first rank (its *leader*) takes part in the outer
sync on a group of the leaders; it then broadcasts the reduced pseudo-gradient inside its
region, and every rank applies the same outer step, so θ_global and the outer momentum are the
same on every rank of the job. The alternative, every rank in a cross-region group of the ranks
with its local index, each exchanging the whole pseudo-gradient, would send L times the bytes
across regions (the ranks of a region hold the same Δ: L copies of one message). Sharding Δ
over those L groups would send the same total as the leaders, spread over L links, but needs
regions of equal size and an all-gather inside the region after; the leaders' way sends the
fewest inter-region bytes with any region sizes. Per outer sync: 2(R−1)/R of the encoded Δ per
leader across regions (a ring all-reduce among R leaders), (L−1)·4·N bytes fp32 from each
leader inside its region.

Reused from DiLoCo, not copied: fragments, the wire codecs (fp32/bf16/int8/sparse), the
token-weighted reduction (`_reduce`, on R `replicas`), the outer step and its warm-up, the
retry-and-agree loop (`_reduce_with_retry`), checkpoints and resume (`_state`), finalize. Every
rank runs that loop: the non-leaders' part of a reduction is empty and succeeds, the leaders'
is the cross-region exchange, and the agreement (a MIN of a success flag over every rank) tells
every rank alike whether the round landed, so the retries' fresh groups are made by every rank
in the same order, as torch requires. A failure of the broadcast inside a region stops the run
(no rank can know what its region peers applied): the last checkpoint's replicas were compared.

One region: no outer step at all. Each step's weights are copied into θ_global (the round is
one step long), so the run is DDP on the region's group, step for step.

Not supported yet: overlapped outer syncs (the broadcast would have to land with them; syncs
block), uneven shares (--micro-batches). The ranks of a region must see equal batches: the
region's token count is its leader's times the region's size.

Bytes are counted as sent, and split in `describe()`: `bytes_intra_region` (DDP's all-reduces,
the region broadcast) and `bytes_inter_region` (everything else: the leaders' pseudo-gradient
and token exchange, every rank's agreement flags and start-up hash).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vpscluster.errors import UserError
from vpscluster.train.strategies.base import CommStats, DistContext
from vpscluster.train.strategies.diloco import DiLoCoStrategy

if TYPE_CHECKING:
    import torch
    from torch import nn

    from vpscluster.train.config import StrategyConfig


@dataclass(frozen=True)
class RegionLayout:
    """Which ranks form each region: regions in the order of their first rank, ranks in order."""

    names: tuple[str, ...]
    members: tuple[tuple[int, ...], ...]

    @classmethod
    def of(cls, rank_regions: list[str]) -> "RegionLayout":
        order: dict[str, list[int]] = {}
        for rank, region in enumerate(rank_regions):
            order.setdefault(region, []).append(rank)
        return cls(tuple(order), tuple(tuple(r) for r in order.values()))

    @property
    def leaders(self) -> list[int]:
        """The first rank of each region: the ranks that sync across regions."""
        return [m[0] for m in self.members]

    def index_of(self, rank: int) -> int:
        return next(i for i, m in enumerate(self.members) if rank in m)


def rank_regions(config: "StrategyConfig", world_size: int, gather_nodes) -> list[str]:
    """The region of each rank: `strategy.regions` (per rank), else `strategy.launcher.node_regions` by the
    node each rank runs on (`gather_nodes()`: every rank's VPSC_NODE, in rank order)."""
    if config.regions is not None:
        if len(config.regions) != world_size:
            raise UserError(f"strategy.regions names {len(config.regions)} regions for {world_size} ranks; "
                            "give one per rank")
        return list(config.regions)
    if config.launcher.node_regions:
        nodes = gather_nodes()
        missing = sorted({n for n in nodes if n not in config.launcher.node_regions})
        if missing:
            raise UserError(f"strategy.launcher.node_regions has no region for node(s) {', '.join(missing)}; "
                            "give every node a labels.region in the cluster file, or run `vpscluster probe` again")
        return [config.launcher.node_regions[n] for n in nodes]
    if world_size <= 1:
        return ["local"]
    raise UserError("--strategy hierarchical needs the region of every rank: give every node a labels.region in "
                    "the cluster file or run `vpscluster probe` (it finds regions from the links); locally, set "
                    "strategy.regions (one per rank) in --config")


class HierarchicalStrategy(DiLoCoStrategy):
    name = "hierarchical"

    def __init__(self, config: "StrategyConfig", ctx: DistContext) -> None:
        super().__init__(config, ctx)
        self.overlap = 0  # blocking outer syncs: the region broadcast follows the reduction
        self.layout = RegionLayout(("local",), (tuple(range(ctx.world_size)),))
        self.region_group = None  # this rank's region's process group (DDP's)
        self.intra: Any = None  # the DDPStrategy inside the region
        self.intra_bytes = 0  # sent inside the region: DDP's all-reduces, the broadcasts
        self.intra_seconds = 0.0
        self.intra_busy_seconds = 0.0

    # -- where the ranks are ---------------------------------------------------------------

    @property
    def region_index(self) -> int:
        return self.layout.index_of(self.ctx.rank)

    @property
    def region(self) -> tuple[int, ...]:
        return self.layout.members[self.region_index]

    @property
    def is_leader(self) -> bool:
        return self.ctx.rank == self.region[0]

    @property
    def replicas(self) -> int:
        """One replica per region."""
        return len(self.layout.members)

    def round_length(self) -> int:
        """H; one step with a single region (θ_global follows DDP's weights step by step)."""
        return self.config.sync_every if self.replicas > 1 else 1

    def _gather_nodes(self) -> list[str]:
        import torch.distributed as dist

        node = os.environ.get("VPSC_NODE", "local")
        out: list[Any] = [None] * self.ctx.world_size
        with self.comm.timed(0):  # a start-up control message, uncounted like the trainer's gathers
            dist.all_gather_object(out, node, group=self.ctx.group)
        return out

    # -- set-up --------------------------------------------------------------------------------

    def setup(self, model: "nn.Module") -> "nn.Module":
        import torch.distributed as dist

        from vpscluster.train.strategies.ddp import DDPStrategy

        self.layout = RegionLayout.of(rank_regions(self.config, self.ctx.world_size, self._gather_nodes))
        if self.ctx.is_distributed:
            # Every rank creates every region's group, in the same order (torch's rule for new_group).
            groups = [dist.new_group(ranks=list(m)) for m in self.layout.members]
            self.region_group = groups[self.region_index]
        super().setup(model)  # fragments, θ_global, the agreement group (every rank)
        if self.ctx.is_distributed and self.sync_group is None:
            self.sync_group = self._new_sync_group()  # the leaders' group (DiLoCo's default would be all ranks)
        region_ctx = DistContext(rank=self.region.index(self.ctx.rank), world_size=len(self.region),
                                 local_rank=self.ctx.local_rank, backend=self.ctx.backend, device=self.ctx.device,
                                 group=self.region_group)
        self.intra = DDPStrategy(self.config, region_ctx)
        return self.intra.setup(model)

    def _new_sync_group(self, short: bool = True):
        """A fresh group of the regions' leaders; every rank calls it alike (non-members get a
        placeholder they never use)."""
        from datetime import timedelta

        import torch.distributed as dist

        timeout = timedelta(seconds=self.config.sync_timeout_s) if short and self.config.sync_timeout_s > 0 else None
        return dist.new_group(ranks=self.layout.leaders, timeout=timeout)

    def collective_groups(self) -> list:
        """The agreement group, this rank's region group and, on a leader, the leaders' group
        (unless the syncs have their own time-out): they wait as long as the loop's collectives."""
        groups = super().collective_groups()
        if self.region_group is not None and len(self.region) > 1:
            groups.append(self.region_group)
        if self.is_leader and self.sync_group is not None and self.config.sync_timeout_s <= 0 and self.replicas > 1:
            groups.append(self.sync_group)
        return groups

    # -- the loop's calls ---------------------------------------------------------------------

    def no_sync(self, accumulating: bool):
        return self.intra.no_sync(accumulating)

    def step(self, optimizer: "torch.optim.Optimizer", step: int) -> None:
        self.intra.step(optimizer, step)  # the region's gradients were all-reduced in backward
        seconds, nbytes = self.intra.comm.take()
        self.comm.add(seconds, nbytes)
        self.intra_bytes += nbytes
        self.intra_seconds += seconds
        self._after_inner_step(step)

    # -- the outer sync ---------------------------------------------------------------------------

    def _sync(self, f: int) -> None:
        if self.replicas > 1:
            return super()._sync(f)
        # One region: nothing to average; θ_global is DDP's weights (no outer step).
        self.global_flat[f] = self._local_flat(f)
        self.steps_since_sync[f] = 0
        self.tokens_since_sync[f] = 0.0

    def _reduce(self, my_tokens: float, delta: "torch.Tensor", group, comm: CommStats) -> "torch.Tensor":
        """Leaders: the token-weighted sum over the regions (DiLoCo's reduction on the leaders'
        group, R replicas). Other ranks: nothing to send; `_reduce_with_retry` fills in the
        leader's result."""
        if not self.is_leader:
            return delta
        return super()._reduce(my_tokens * len(self.region), delta, group, comm)

    def _reduce_with_retry(self, my_tokens: float, delta: "torch.Tensor",
                           comm: CommStats | None = None) -> "torch.Tensor | None":
        """DiLoCo's retry-and-agree loop on every rank, then the leader's result broadcast inside
        the region (fp32: every rank applies the same bytes)."""
        import time

        import torch.distributed as dist

        comm = comm or self.comm
        reduced = super()._reduce_with_retry(my_tokens, delta, comm)
        if reduced is None or len(self.region) == 1:
            return reduced
        buf = reduced.contiguous().to(self.comm_device)
        nbytes = buf.numel() * buf.element_size() * (len(self.region) - 1) if self.is_leader else 0
        t0 = time.perf_counter()
        dist.broadcast(buf, src=self.region[0], group=self.region_group)
        seconds = time.perf_counter() - t0
        comm.add(seconds, nbytes)
        self.intra_bytes += nbytes
        self.intra_seconds += seconds
        return buf.cpu()

    def retune(self, settings: dict[str, Any]) -> None:
        """DiLoCo's retune; the syncs stay blocking (DiLoCo's would turn the overlap back on)."""
        super().retune(settings)
        self.overlap = 0

    # -- what the loop reads ----------------------------------------------------------------------

    def describe(self) -> dict[str, Any]:
        out = super().describe()
        intra = self.intra.describe() if self.intra is not None else {}
        out.update({
            "name": self.name,
            "sync_every": self.round_length(),
            "overlap_steps": 0,
            "regions": [{"name": n, "ranks": list(m)} for n, m in zip(self.layout.names, self.layout.members)],
            "region": self.layout.names[self.region_index],
            "leader": self.is_leader,
            "compress": self.config.compress,
            "bytes_intra_region": self.intra_bytes,
            "bytes_inter_region": self.comm.total_bytes_sent - self.intra_bytes,
            "intra_region_seconds": round(self.intra_seconds, 6),
            "intra_collective_busy_seconds": intra.get("collective_busy_seconds"),
        })
        return out

    def close(self) -> None:
        super().close()
        if self.intra is not None:
            self.intra.close()
