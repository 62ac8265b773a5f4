"""Small pieces of the trainer: LR schedule, world-size-1 strategy, config precedence, progress view."""

from __future__ import annotations

import argparse
import io

import pytest

from vpscluster.config import build
from vpscluster.train.config import StrategyConfig, TrainConfig
from vpscluster.train.trainer import lr_at


def test_lr_warmup_then_cosine_to_floor():
    cfg = build(TrainConfig, {"lr": 1e-3, "warmup_steps": 10, "max_steps": 110, "min_lr_ratio": 0.1})
    assert lr_at(cfg, 5) == pytest.approx(5e-4)
    assert lr_at(cfg, 10) == pytest.approx(1e-3)
    assert lr_at(cfg, 60) == pytest.approx(1e-4 + 0.9e-3 * 0.5)  # half-way down the cosine
    assert lr_at(cfg, 110) == pytest.approx(1e-4)
    assert lr_at(cfg, 500) == pytest.approx(1e-4)  # past the horizon: the floor


def test_the_peak_lr_is_the_presets_unless_set():
    from vpscluster.errors import UserError
    from vpscluster.train.presets import DEFAULT_LR, preset_lr

    # small at 3e-3 stalled near val 2.43 in 900-s runs; at 2e-3 it reached 1.68 (BENCHMARKS.md)
    assert preset_lr("small") == 2e-3 and preset_lr("Tiny") == 3e-3 and preset_lr("125m") == DEFAULT_LR
    assert build(TrainConfig, {"preset": "small"}).peak_lr() == 2e-3
    assert build(TrainConfig, {"preset": "small", "lr": 5e-4}).peak_lr() == 5e-4
    small = build(TrainConfig, {"preset": "small", "warmup_steps": 10, "max_steps": 110})
    assert lr_at(small, 10) == pytest.approx(2e-3) and lr_at(small, 110) == pytest.approx(2e-4)
    with pytest.raises(UserError, match="unknown preset"):
        preset_lr("huge")
    with pytest.raises(UserError, match="lr must be positive"):
        build(TrainConfig, {"lr": -1e-3})


def test_lr_horizon_independent_of_max_steps_once_fixed():
    a = build(TrainConfig, {"max_steps": 100, "lr_decay_steps": 100})
    b = build(TrainConfig, {"max_steps": 300, "lr_decay_steps": 100})
    assert all(lr_at(a, s) == lr_at(b, s) for s in range(1, 101))


def test_world_size_one_has_no_wrapper_and_no_comm():
    import torch

    from vpscluster.train.model import build_model
    from vpscluster.train.presets import ModelShape
    from vpscluster.train.strategies.base import DistContext
    from vpscluster.train.strategies.ddp import DDPStrategy

    model = build_model(ModelShape(d_model=16, n_layer=1, n_head=2, seq_len=8), seed=0)
    strategy = DDPStrategy(StrategyConfig(compress="bf16"), DistContext())
    assert strategy.setup(model) is model and strategy.unwrap() is model
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.zeros(1, 8, dtype=torch.long), torch.ones(1, 8, dtype=torch.long)).backward()
    strategy.step(opt, 1)
    assert strategy.comm.take() == (0.0, 0)


def test_config_precedence_defaults_yaml_flags(tmp_path):
    from vpscluster.cli.train import add_arguments, resolve_config

    (tmp_path / "c.yaml").write_text("max_steps: 77\nlr: 0.01\nstrategy:\n  compress: bf16\n")
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    cfg = resolve_config(parser.parse_args(["--config", str(tmp_path / "c.yaml"), "--lr", "0.02", "--powersgd-rank", "2"]))
    assert cfg.max_steps == 77  # from the file
    assert cfg.lr == 0.02  # the flag wins
    assert cfg.strategy.compress == "bf16" and cfg.strategy.powersgd_rank == 2  # nested keys merge
    assert cfg.seed == TrainConfig().seed  # untouched default
    default = resolve_config(parser.parse_args([]))
    assert default == TrainConfig()


def test_progress_view_renders_events_and_summary():
    from rich.console import Console

    from vpscluster.cli.progress import ProgressView

    buf = io.StringIO()
    view = ProgressView(console=Console(file=buf, width=120))
    view.handle({"event": "start", "world_size": 2, "max_steps": 4, "start_step": 0, "strategy": {"name": "ddp", "compress": "none"},
                 "preset": "tiny", "num_params": 1040768, "backend": "gloo", "threads_per_rank": 1, "run_dir": "runs/x"})
    view.handle({"event": "eval", "step": 0, "val_loss": 5.58})
    for s in range(1, 5):
        view.handle({"event": "step", "step": s, "max_steps": 4, "loss": 5.0 - s, "tokens_per_s": 1000.0, "comm_share": 0.25})
    report = {"strategy": "ddp", "world_size": 2, "steps": 4, "tokens": 16384, "wall_seconds": 2.0, "tokens_per_s": 8192.0,
              "compute_seconds": 1.5, "comm_seconds": 0.5, "compute_utilization": 0.75, "final_train_loss": 1.0,
              "final_val_loss": 1.2, "bytes_sent": [4_000_000, 4_000_000], "initial_val_loss": 5.58, "run_dir": "runs/x"}
    view.handle({"event": "end", "report": report})
    view.summary(report)
    out = buf.getvalue()
    assert "training tiny (1.04M parameters) on 2 rank(s)" in out
    assert "validation loss 5.5800" in out
    assert "75.0%" in out and "5.580 -> 1.200" in out and "4.0 MB, 4.0 MB" in out
    assert view.report == report


def test_progress_view_suggests_finer_micro_batches_once_when_the_split_is_coarse():
    from rich.console import Console

    from vpscluster.cli.progress import ProgressView
    from vpscluster.train.shares import split, split_gap

    buf = io.StringIO()
    view = ProgressView(console=Console(file=buf, width=200))
    speeds = [0.6, 0.3, 0.15]
    coarse, fine = split(speeds, 12), split(speeds, 24)
    assert (coarse, fine) == ([8, 3, 1], [14, 7, 3])
    for step, gap in ((3, split_gap(coarse, speeds)), (8, split_gap(coarse, speeds))):
        view.handle({"event": "rebalance", "step": step, "shares_before": [4, 4, 4], "shares": coarse,
                     "rebalances": 1, "split_gap": gap, "batch_size": 2})
    out = buf.getvalue()
    assert out.count("17% slower than an exact one") == 1, out
    assert "--batch-size 1 --micro-batches 24 keeps the global batch" in out

    buf = io.StringIO()
    view = ProgressView(console=Console(file=buf, width=200))
    view.handle({"event": "rebalance", "step": 3, "shares_before": [8, 8, 8], "shares": fine,
                 "rebalances": 1, "split_gap": split_gap(fine, speeds), "batch_size": 1})
    assert "slower than an exact" not in buf.getvalue()

    # DiLoCo: a micro-batch is an inner step, so the hint keeps its size and the inner steps a round
    buf = io.StringIO()
    view = ProgressView(console=Console(file=buf, width=200))
    view.handle({"event": "rebalance", "step": 10, "shares_before": [4, 4, 4], "shares": coarse,
                 "rebalances": 1, "split_gap": split_gap(coarse, speeds), "batch_size": 2, "sync_every": 10})
    assert "--micro-batches 24 --sync-every 5 keeps the inner steps per round" in buf.getvalue(), buf.getvalue()
    assert "--batch-size 1" not in buf.getvalue()
