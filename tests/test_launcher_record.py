"""The launcher's record (`strategy.launcher`: planned keys and reason, replan inputs, node speeds
and regions) is kept apart from the user's strategy settings, round-trips through a run's
config.yaml, and a config.yaml written before the record existed (flat keys) still resumes."""

from __future__ import annotations

import argparse

import pytest

from vpscluster.errors import UserError
from vpscluster.train.config import LauncherChoices, StrategyConfig, TrainConfig
from vpscluster.train.rundir import read_config, write_config

# strategy: as a run dir's config.yaml held it before `launcher` (the launcher's keys flat).
OLD_STRATEGY = """\
strategy:
  name: diloco
  sync_every: 10
  wire_dtype: int8
  planned: [sync_every, wire_dtype]
  planned_reason: H=10 int8 on a 12 Mbit/s ring
  replan: {step_seconds: 0.5, step_source: measured, bandwidth_bytes_s: 1.5e6, latency_s: 0.01,
           num_params: 1.0e6, choices: [10, 20], wires: [fp32, bf16, int8], keys: [sync_every, wire_dtype]}
  node_speeds: {n1: 2.0e9, n2: 1.0e9}
  node_regions: {n1: fra, n2: lax}
"""


def test_an_old_flat_run_config_still_resumes(tmp_path):
    from vpscluster.cli import train as train_cli

    (tmp_path / "config.yaml").write_text("max_steps: 40\ncheckpoint_every: 20\n" + OLD_STRATEGY)
    cfg = read_config(tmp_path)
    s, rec = cfg.strategy, cfg.strategy.launcher
    assert (s.name, s.sync_every, s.wire_dtype) == ("diloco", 10, "int8")
    assert rec.planned == ["sync_every", "wire_dtype"] and rec.planned_reason.startswith("H=10 int8")
    assert rec.replan.choices == [10, 20] and rec.replan.step_seconds == 0.5
    assert rec.node_speeds == {"n1": 2e9, "n2": 1e9} and rec.node_regions == {"n1": "fra", "n2": "lax"}
    p = argparse.ArgumentParser()
    train_cli.add_arguments(p)
    resumed = train_cli.resolve_resume(p.parse_args(["--resume", str(tmp_path), "--max-steps", "60"]))
    assert resumed.max_steps == 60 and resumed.strategy == s  # the record carried over whole
    # Written again, the record is its own section: nothing of it is left among the settings.
    write_config(resumed, tmp_path)
    text = (tmp_path / "config.yaml").read_text()
    assert "  launcher:\n" in text and "\n  planned:" not in text
    assert read_config(tmp_path) == resumed


def test_the_record_is_checked_and_kept_out_of_the_user_keys(tmp_path):
    from vpscluster.train.config import config_keys

    with pytest.raises(UserError, match="launcher.node_speeds must map node names to positive numbers"):
        LauncherChoices(node_speeds={"n1": 0.0})
    with pytest.raises(UserError, match="launcher.node_regions must map node names to region names"):
        StrategyConfig(launcher=LauncherChoices(node_regions={"n1": ""}))
    assert "launcher" not in config_keys() and "planned" not in config_keys()
    s = StrategyConfig(name="diloco")
    t = s.with_launcher(planned=["sync_every"])
    assert s.launcher.planned == [] and t.launcher.planned == ["sync_every"] and t.name == "diloco"
    # The flat keys are read as the record's, not as settings: a typo among them is still refused.
    (tmp_path / "config.yaml").write_text("strategy: {name: diloco, planned: [sync_every], plannd_reason: x}\n")
    with pytest.raises(UserError, match="unknown key 'plannd_reason'"):
        read_config(tmp_path)
    assert TrainConfig().strategy.launcher == LauncherChoices()
