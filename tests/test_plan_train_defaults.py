"""`train --strategy diloco` with no tuning flag: H, wire and outer optimizer come from the plan."""

from __future__ import annotations

import argparse

from conftest import run_cli

from vpscluster.train.strategies import sync_rule


def _args(*argv):
    from vpscluster.cli.train import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def test_the_keys_the_user_set_by_flag_or_config_file(tmp_path):
    from vpscluster.cli.train import given_strategy_keys

    cfg = tmp_path / "my.yaml"
    cfg.write_text("strategy: {name: diloco, outer_lr: 0.5}\nmax_steps: 40\n")
    assert given_strategy_keys(_args("--config", str(cfg), "--sync-every", "20")) == {"name", "outer_lr", "sync_every"}
    word = tmp_path / "word.yaml"
    word.write_text("strategy: diloco\n")
    assert given_strategy_keys(_args("--config", str(word), "--outer-warmup", "0")) == {"outer_warmup"}
    assert given_strategy_keys(_args("--strategy", "diloco")) == {"name"}


def test_prepare_training_plans_what_is_open_keeps_what_is_set_and_resume_changes_nothing(tmp_path):
    from vpscluster.cli.train import given_strategy_keys, resolve_config
    from vpscluster.launch.train import prepare_training
    from vpscluster.train import rundir

    args = _args("--nodes", "2", "--preset", "tiny", "--strategy", "diloco", "--sync-every", "25",
                 "--max-steps", "200", "--run-dir", str(tmp_path / "run"))
    run = prepare_training(resolve_config(args), given=given_strategy_keys(args))
    s = run.cfg.strategy
    assert s.sync_every == 25 and "sync_every" not in s.launcher.planned
    assert s.launcher.planned == ["outer_lr", "outer_momentum", "outer_warmup", "wire_dtype"]
    assert s.outer_warmup == sync_rule.outer_warmup_for(25) and s.wire_dtype in sync_rule.WIRES
    assert run.strategy_line().startswith("strategy diloco: H=25 ") and "as set: sync_every" in run.strategy_line()
    rundir.write_config(run.cfg, tmp_path)  # the record travels with the run's config
    assert rundir.read_config(tmp_path).strategy == s
    # A resumed run keeps its stored configuration: nothing is re-planned.
    stored = run.cfg
    stored.strategy.outer_warmup = 7
    again = prepare_training(stored, resume_dir=tmp_path)
    assert again.cfg.strategy == stored.strategy and again.strategy_reason is None
    # A user who sets every key gets exactly those values, and nothing is planned.
    args = _args("--nodes", "2", "--preset", "tiny", "--strategy", "diloco", "--sync-every", "50", "--wire-dtype", "bf16",
                 "--outer-lr", "0.5", "--outer-momentum", "0.8", "--outer-warmup", "0", "--run-dir", str(tmp_path / "r2"))
    fixed = prepare_training(resolve_config(args), given=given_strategy_keys(args))
    s = fixed.cfg.strategy
    assert (s.sync_every, s.wire_dtype, s.outer_lr, s.outer_momentum, s.outer_warmup) == (50, "bf16", 0.5, 0.8, 0)
    assert s.launcher.planned == [] and fixed.strategy_line() is None


def test_checkpoints_fall_on_outer_steps_of_the_planned_h_and_a_set_h_that_misses_is_refused(tmp_path):
    from vpscluster.cli.train import given_strategy_keys, resolve_config
    from vpscluster.errors import UserError
    from vpscluster.launch.train import prepare_training

    # H is open: the plan takes one that checkpoint_every is a multiple of (the default H, 100, is not).
    args = _args("--nodes", "2", "--preset", "tiny", "--strategy", "diloco", "--checkpoint-every", "30",
                 "--max-steps", "300", "--run-dir", str(tmp_path / "run"))
    s = prepare_training(resolve_config(args), given=given_strategy_keys(args)).cfg.strategy
    assert "sync_every" in s.launcher.planned and 30 % s.sync_every == 0
    # H is set and checkpoints would fall between outer steps: refused in one line, naming both.
    args = _args("--nodes", "2", "--preset", "tiny", "--strategy", "diloco", "--checkpoint-every", "30",
                 "--sync-every", "100", "--run-dir", str(tmp_path / "r2"))
    try:
        prepare_training(resolve_config(args), given=given_strategy_keys(args))
    except UserError as e:
        assert "checkpoint_every (30) must be a multiple of sync_every (100)" in str(e) and "\n" not in str(e)
    else:
        raise AssertionError("a set H that checkpoints miss was accepted")


def test_train_prints_the_planned_choice_and_its_reason(tmp_path):
    r = run_cli("train", "--nodes", "2", "--preset", "tiny", "--strategy", "diloco", "--dry-run",
                "--run-dir", str(tmp_path / "run"), timeout=120)
    assert r.returncode == 0, r.stderr
    text = " ".join(r.stdout.split())
    # Why: the sync's share of a round against the 5% target, or hidden behind the overlap.
    assert "strategy diloco: H=" in text and ("target" in text or "hidden behind" in text)
