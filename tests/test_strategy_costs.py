"""Each strategy's torch-free cost companion (`train/strategies/costs.py`): registered beside the
strategy, agreeing with it, and the only place outside the strategies that knows a name."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

import vpscluster
from vpscluster.errors import UserError
from vpscluster.train.config import StrategyConfig, TrainConfig
from vpscluster.train.strategies import COSTS, STRATEGIES, costs_for, get_strategy_class
from vpscluster.train.strategies.base import DistContext

PACKAGE = Path(vpscluster.__file__).parent
FIELDS = {f.name for f in dataclasses.fields(StrategyConfig)}
# Branches on a strategy's name that remain outside the strategies, in code another change owns
# (the trainer and the session, being split); none may be added.
KNOWN_BRANCHES: set[str] = set()  # none left


def test_every_strategy_has_a_companion_of_its_name():
    assert list(COSTS) == list(STRATEGIES)
    for name in STRATEGIES:
        costs = costs_for(name)
        assert costs.name == name == get_strategy_class(name).name
        assert set(costs.settings_keys) <= FIELDS, name
        assert set(costs.planned_keys) <= set(costs.settings_keys), name
    with pytest.raises(UserError, match="unknown strategy 'auto'; choose one of: ddp, "):
        costs_for("auto")


def test_the_running_strategy_answers_from_its_companion():
    for name, every in (("ddp", 1), ("diloco", 20), ("hierarchical", 20)):
        s = get_strategy_class(name)(StrategyConfig(name=name, sync_every=20), DistContext())
        assert s.costs is costs_for(name)
        assert s.steps_per_sync() == every
        assert s.micro_batches_are_steps is (name == "diloco")


def test_the_configs_rules_ask_the_companion():
    with pytest.raises(UserError, match="--compress applies to ddp; for diloco"):
        TrainConfig(strategy=StrategyConfig(name="diloco", compress="bf16"))
    TrainConfig(strategy=StrategyConfig(name="ddp", compress="bf16"))
    cfg = TrainConfig(checkpoint_every=30, strategy=StrategyConfig(name="diloco", sync_every=20))
    with pytest.raises(UserError, match="must be a multiple of sync_every"):
        cfg.validate()
    TrainConfig(checkpoint_every=30, strategy=StrategyConfig(name="ddp", sync_every=20)).validate()


def _name_branches(path: Path) -> list[int]:
    """Lines comparing something to a registered strategy's name (==, !=, in (...))."""
    names = set(STRATEGIES)

    def is_name(node) -> bool:
        if isinstance(node, ast.Constant):
            return node.value in names
        return isinstance(node, (ast.Tuple, ast.List, ast.Set)) and any(is_name(e) for e in node.elts)

    return [node.lineno for node in ast.walk(ast.parse(path.read_text(), str(path)))
            if isinstance(node, ast.Compare) and any(is_name(c) for c in [node.left, *node.comparators])
            and all(isinstance(op, (ast.Eq, ast.NotEq, ast.In, ast.NotIn)) for op in node.ops)]


def test_nothing_outside_the_strategies_branches_on_a_strategy_name():
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel.startswith("train/strategies/") or rel in KNOWN_BRANCHES:
            continue
        if lines := _name_branches(path):
            found[rel] = lines
    assert found == {}, f"ask the strategy's cost companion (train/strategies/costs.py) instead: {found}"


def test_the_scan_sees_a_branch(tmp_path):
    f = tmp_path / "m.py"
    f.write_text('def f(s):\n    if s.name == "diloco":\n        pass\n    return x in ("ddp", "other")\n')
    assert _name_branches(f) == [2, 4]
