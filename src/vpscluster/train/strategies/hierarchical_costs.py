"""The hierarchical strategy's cost companion (`costs.py`): DDP inside each region every step,
blocking DiLoCo among one leader per region every H steps (`hierarchical.py`).

What a sync costs depends on the regions' links, which only the planner knows: `by_region`
tells it to price the strategy on the regions (`plan/hierarchical.py`: the ddp companion on each
region's ring, the diloco companion on the leaders'). The answers here that need no links are
DiLoCo's (H, the wire, the outer state, the sync rule's keys) and DDP's (the all-reduce inside a
region may be compressed).
"""

from __future__ import annotations

from vpscluster.train.strategies.diloco_costs import DiLoCoCosts

# Less quality risk than flat DiLoCo at the same H and wire when the regions are fewer than the
# ranks: R replicas of L times the batch learn more per token than R·L replicas (Charles et al.,
# 2025: +0.7% at 2 replicas against +2.0% at 4 for a 35M model at equal tokens).
FEWER_REPLICAS = 0.5


class HierarchicalCosts(DiLoCoCosts):
    name = "hierarchical"
    settings_keys = (*DiLoCoCosts.settings_keys, "compress", "powersgd_rank", "powersgd_start_step", "bucket_mb",
                     "regions")
    micro_batches_are_steps = False  # a rank's micro-batches would be one gradient, as in ddp
    uneven_shares = False  # not supported yet
    by_region = ("ddp", "diloco")

    def risk_on_regions(self, s, total_steps: int | None, n_regions: int, world_size: int) -> float:
        """DiLoCo's risk at this H and wire, less FEWER_REPLICAS where a region holds several ranks."""
        risk = self.quality_risk(s, total_steps)
        return max(0.0, risk - FEWER_REPLICAS) if n_regions < world_size else risk

    def candidates(self, base, world_size, sync_every_choices) -> list:
        return []  # only where regions exist: the planner builds it from them (`plan/hierarchical.py`)


COSTS = HierarchicalCosts()
