"""`train` and `run` build their configuration flags from the config fields' metadata
(`config.Flag`, `cli/flags.py`): every flag reaches its key, help shows the real defaults,
and nothing on the `--help` path imports pydantic or torch."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys

import pytest

from vpscluster.config import flag_fields
from vpscluster.session.config import SessionConfig
from vpscluster.train.config import RecoveryConfig, StrategyConfig, TrainConfig


def _parser(module) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="vpscluster")
    module.add_arguments(p)
    return p


def _actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {o: a for a in parser._actions for o in a.option_strings}


def test_every_flagged_field_becomes_one_flag_and_reaches_its_key():
    from vpscluster.cli import train as train_cli

    keys = train_cli.flag_keys()
    fields = flag_fields(TrainConfig, "train")
    assert len(keys) == len(fields) and keys["sync_every"] == "strategy.sync_every"
    assert keys["time_budget"] == "time_budget_s" and keys["max_restarts"] == "recovery.max_restarts"
    assert keys["exporters"] == "exporters" and "collective_timeout" not in keys  # a `run` flag only
    actions = _actions(_parser(train_cli))
    for ff in fields:
        assert actions[ff.flag.name].dest == ff.flag.dest
        assert actions[ff.flag.name].default is None  # None = not given: the config's default holds
    args = _parser(train_cli).parse_args(
        ["--strategy", "diloco", "--sync-every", "10", "--speeds", "3,1", "--no-balance", "--no-exporters",
         "--max-spread", "2", "--min-nodes", "1", "--lr", "0.01", "--micro-batches", "4"])
    cfg = train_cli.resolve_config(args)
    s = cfg.strategy
    assert (s.name, s.sync_every, s.speeds, s.balance, s.max_spread, s.micro_batches) == \
        ("diloco", 10, [3.0, 1.0], False, 2.0, 4)
    assert (cfg.exporters, cfg.recovery.min_nodes, cfg.lr) == (False, 1, 0.01)
    assert train_cli.resume_flags() == ("max_steps", "time_budget", "nodes", "nproc_per_node", "cluster",
                                        "max_restarts", "min_nodes")


def test_help_shows_the_config_defaults_and_the_commands_own_texts():
    from vpscluster.cli import run as run_cli
    from vpscluster.cli import train as train_cli
    from vpscluster.train.presets import preset_lrs_text

    train_help = _parser(train_cli).format_help()
    run_help = _parser(run_cli).format_help()
    for text in (train_help, run_help):  # no placeholder left unfilled
        assert re.search(r"\{[a-z_.]+(:[^}]*)?\}", text) is None, text
    d = StrategyConfig()
    assert f"(default {d.rebalance_every})" in train_help and f"(default {d.max_spread:g};" in train_help
    assert preset_lrs_text() in " ".join(train_help.split())
    assert f"(default {d.sync_every})" in " ".join(run_help.split())  # run's own text: no plan there
    assert "default: from the plan" in " ".join(train_help.split())
    assert "--collective-timeout" in run_help and "--collective-timeout" not in train_help
    assert "--outer-lr" not in run_help


def test_run_flags_are_the_session_and_recovery_fields():
    from vpscluster.cli import run as run_cli

    keys = run_cli.session_keys()
    assert keys == {ff.flag.dest: ff.key for ff in flag_fields(SessionConfig, "run")}
    assert keys["collective_timeout"] == "timeouts.train_collective_s" and keys["wire_dtype"] == "strategy.wire_dtype"
    assert [ff.key for ff in flag_fields(RecoveryConfig, "run")] == ["max_restarts", "min_nodes"]
    p = _parser(run_cli)
    with pytest.raises(SystemExit):
        p.parse_args(["--nodes", "2", "--speeds", "3,x", "--", "python", "x.py"])  # one line from argparse


def test_the_cli_parser_imports_neither_pydantic_nor_torch():
    code = ("import sys; from vpscluster.cli import build_parser; build_parser(); "
            "print(sorted(m for m in ('pydantic', 'torch') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]", out.stderr
