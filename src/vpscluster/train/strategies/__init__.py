"""Sync strategies by name. Each lives in its own module and is imported only when chosen.

This registry is the one list of strategy names: the typed config (`StrategyConfig.name`), the
CLI's choices, the planner's candidates and the YAML loader all read it from here.

A strategy is two modules, both named here: the one that runs it (torch, on the ranks) and its
torch-free cost companion (`costs.py`: bytes, memory, sync points, flags, candidates), which the
planner, the launcher and the benches ask instead of branching on its name. Adding a strategy is
adding its line to STRATEGIES and to COSTS (`tests/test_strategy_costs.py` checks both lists
agree).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from vpscluster.errors import UserError

if TYPE_CHECKING:
    from vpscluster.train.strategies.base import Strategy
    from vpscluster.train.strategies.costs import StrategyCosts

# name -> "module:Class"
STRATEGIES: dict[str, str] = {
    "ddp": "vpscluster.train.strategies.ddp:DDPStrategy",
    "diloco": "vpscluster.train.strategies.diloco:DiLoCoStrategy",
    "hierarchical": "vpscluster.train.strategies.hierarchical:HierarchicalStrategy",
}
# name -> "module:instance" of its cost companion (torch-free)
COSTS: dict[str, str] = {
    "ddp": "vpscluster.train.strategies.ddp_costs:COSTS",
    "diloco": "vpscluster.train.strategies.diloco_costs:COSTS",
    "hierarchical": "vpscluster.train.strategies.hierarchical_costs:COSTS",
}
# The same strategies on a quorum of replica groups (`strategy.quorum`): name -> "module:Class".
QUORUM_ENGINES: dict[str, str] = {
    "diloco": "vpscluster.train.strategies.quorum_diloco:QuorumDiLoCoStrategy",
}
# Not a strategy: asks the planner (`plan/auto.py`) to choose one of STRATEGIES before training.
AUTO = "auto"
# What a user may write for `strategy.name` / `--strategy`.
CHOICES: tuple[str, ...] = (*STRATEGIES, AUTO)


def get_strategy_class(name: str, quorum: bool = False) -> type["Strategy"]:
    """The strategy `name`; with `quorum`, its engine on a torchft quorum (`quorum_diloco.py`)."""
    try:
        target = (QUORUM_ENGINES if quorum else STRATEGIES)[name]
    except KeyError:
        if quorum and name in STRATEGIES:
            raise UserError(f"strategy {name!r} has no quorum engine yet; choose one of: {', '.join(QUORUM_ENGINES)}") from None
        raise UserError(f"unknown strategy {name!r}; choose one of: {', '.join(STRATEGIES)}") from None
    return _load(target)


def costs_for(name: str) -> "StrategyCosts":
    """The cost companion of strategy `name` (`costs.py`)."""
    try:
        target = COSTS[name]
    except KeyError:
        raise UserError(f"unknown strategy {name!r}; choose one of: {', '.join(STRATEGIES)}") from None
    return _load(target)


def _load(target: str):
    module_name, attr = target.split(":")
    return getattr(importlib.import_module(module_name), attr)
