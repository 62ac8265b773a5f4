"""`vpscluster run --nodes 2 [--strategy ...] -- python examples/image_classifier.py`: a user's
script with the session API, through the real launcher (torchrun, 2 local ranks).

- ddp and diloco (H = 8, int8 wire) both learn (the loss falls from the first steps to the end);
- diloco's report shows far fewer bytes sent than ddp's for the same steps;
- every rank ends with the same weights (hashes in the report);
- the launcher's flags reach the script's `session.start()` (session.json in the run dir).
Plain `python examples/image_classifier.py` (no launcher) is run too.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from conftest import REPO, run_cli

ARGS = ("--", "python", "examples/image_classifier.py", "--epochs", "2", "--samples", "2048")


def _run(tmp_path, name, *flags):
    run_dir = tmp_path / name
    r = run_cli("run", "--nodes", "2", "--run-dir", str(run_dir), *flags, *ARGS, cwd=str(REPO), timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    report = json.loads((run_dir / "report.json").read_text())
    losses = [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return report, losses, json.loads((run_dir / "session.json").read_text()), r.stdout


def test_run_strategy_diloco_cuts_bytes_against_ddp_and_both_learn(tmp_path):
    ddp, ddp_losses, _, _ = _run(tmp_path, "ddp")
    diloco, diloco_losses, settings, out = _run(tmp_path, "diloco", "--strategy", "diloco", "--sync-every", "8",
                                                "--wire-dtype", "int8", "--overlap-steps", "1")
    assert settings["strategy"]["name"] == "diloco" and settings["strategy"]["sync_every"] == 8
    assert "test accuracy" in out
    for report, losses, name in ((ddp, ddp_losses, "ddp"), (diloco, diloco_losses, "diloco")):
        assert report["strategy"] == name and report["world_size"] == 2
        assert report["steps"] == 2 * 2048 // 64 == len(losses)
        assert len({r["model_sha256"] for r in report["per_rank"]}) == 1, f"{name}: ranks differ"
        assert report["final_train_loss"] < 0.8 * sum(losses[:3]) / 3, f"{name}: loss did not fall: {losses}"
    d = diloco["strategy_details"]
    assert (d["sync_every"], d["wire_dtype"], d["overlap_steps"]) == (8, "int8", 1)
    # ddp: fp32 gradients every step; diloco: int8 pseudo-gradients every 8th: > 8x fewer bytes.
    assert sum(diloco["bytes_sent"]) * 8 < sum(ddp["bytes_sent"])


def test_run_strategy_auto_chooses_on_measured_steps_the_same_on_every_rank(tmp_path):
    """`run --nodes 2 --strategy auto`: the ranks train DDP for the measured window, then run what
    the rule chose on their gathered figures; report.json holds the choice, one line says it on
    rank 0, the rule gives the same answer again on the recorded figures, and every rank ends
    with the same weights."""
    from vpscluster.train.strategies import sync_rule as auto
    from vpscluster.session.auto import WARMUP_STEPS, WINDOW_STEPS

    report, losses, settings, out = _run(tmp_path, "auto", "--strategy", "auto")
    choice = report["strategy_choice"]
    assert settings["strategy"]["name"] == "auto" and settings["auto"]["bandwidth_bytes_s"] > 0
    assert choice["at_step"] == WARMUP_STEPS + WINDOW_STEPS
    assert report["strategy"] == choice["settings"]["name"]
    said = [line for line in out.splitlines() if "strategy auto -> " in line]
    assert len(said) == 1 and said[0].endswith(choice["reason"]), said
    m = choice["measured"]
    again, reason = auto.choose_measured(m["compute_s"], m["comm_s"], m["num_params"], 2,
                                         settings["auto"]["bandwidth_bytes_s"], settings["auto"]["latency_s"],
                                         ddp_bytes_per_step=m["bytes_per_step"], overlap_steps=1)
    assert again == choice["settings"] and choice["reason"].startswith(reason)
    if report["strategy"] == "diloco":
        assert report["strategy_details"]["sync_every"] == choice["settings"]["sync_every"]
    assert m["num_params"] == 6852  # SmallCNN's parameters, counted by the session at setup
    assert len({r["model_sha256"] for r in report["per_rank"]}) == 1
    assert report["final_train_loss"] < 0.8 * sum(losses[:3]) / 3, losses


def test_example_runs_as_a_plain_script():
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "VPSC_SESSION")}
    r = subprocess.run([sys.executable, "examples/image_classifier.py", "--epochs", "1", "--samples", "512"],
                       cwd=str(REPO), capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "test accuracy" in r.stdout and "ddp, 0 bytes sent" in r.stdout


def test_sentiment_example_learns_under_diloco(tmp_path):
    run_dir = tmp_path / "sentiment"
    r = run_cli("run", "--nodes", "2", "--run-dir", str(run_dir), "--strategy", "diloco", "--sync-every", "4",
                "--", "python", "examples/sentiment.py", "--epochs", "2", "--rows", "2048",
                cwd=str(REPO), timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    report = json.loads((run_dir / "report.json").read_text())
    losses = [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert report["strategy"] == "diloco" and report["steps"] == 2 * 2048 // 64 == len(losses)
    assert len({r["model_sha256"] for r in report["per_rank"]}) == 1
    assert report["final_train_loss"] < 0.8 * sum(losses[:3]) / 3, losses
    assert "test accuracy" in r.stdout


def test_run_flags_become_the_session_settings_with_trains_keys():
    import argparse

    from vpscluster.cli import run as run_cli_module

    p = argparse.ArgumentParser()
    run_cli_module.add_arguments(p)
    args = p.parse_args(["--nodes", "2", "--strategy", "diloco", "--sync-every", "8", "--wire-dtype", "int8",
                         "--overlap-steps", "2", "--time-budget", "30", "--micro-batches", "4", "--speeds", "3,1",
                         "--checkpoint-every", "16", "--", "python", "x.py"])
    cfg = run_cli_module.session_settings(args)
    s = cfg.strategy
    assert (s.name, s.sync_every, s.wire_dtype, s.overlap_steps, s.micro_batches, s.speeds) == \
        ("diloco", 8, "int8", 2, 4, [3.0, 1.0])
    assert (cfg.time_budget_s, cfg.checkpoint_every, cfg.resume) == (30.0, 16, False)
    plain = run_cli_module.session_settings(p.parse_args(["--nodes", "2", "--", "python", "x.py"]))
    assert plain.strategy.name == "ddp" and plain.time_budget_s is None


def test_hugging_face_transformer_example_learns_under_ddp_with_identical_weights(tmp_path):
    """examples/hf_transformer.py: a GPT-2 built from a config (transformers, the `hf` extra, in
    the test extra so CI runs it), trained through the session on 2 ranks with DDP."""
    run_dir = tmp_path / "hf"
    r = run_cli("run", "--nodes", "2", "--run-dir", str(run_dir), "--", "python", "examples/hf_transformer.py",
                "--epochs", "1", "--rows", "1024", cwd=str(REPO), timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    report = json.loads((run_dir / "report.json").read_text())
    losses = [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert report["strategy"] == "ddp" and report["world_size"] == 2 and report["steps"] == 1024 // (2 * 16) == len(losses)
    assert len({r["model_sha256"] for r in report["per_rank"]}) == 1
    assert report["final_train_loss"] < 0.8 * sum(losses[:3]) / 3, losses


def test_run_strategy_auto_resumes_with_the_choice_it_made(tmp_path):
    """A checkpoint after the choice holds it: `run --resume RUN_DIR --strategy auto` runs the
    chosen strategy from the first step again (no new measuring), and the ranks end equal."""
    run_dir = tmp_path / "auto"
    args = ("--", "python", "examples/image_classifier.py", "--samples", "1024")
    first = run_cli("run", "--nodes", "2", "--run-dir", str(run_dir), "--strategy", "auto", "--checkpoint-every", "10",
                    *args, "--epochs", "1", cwd=str(REPO), timeout=300)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    made = json.loads((run_dir / "report.json").read_text())["strategy_choice"]
    r = run_cli("run", "--nodes", "2", "--resume", str(run_dir), "--strategy", "auto", "--checkpoint-every", "10",
                *args, "--epochs", "2", cwd=str(REPO), timeout=300)  # the epochs in all: one more (s.epoch)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    report = json.loads((run_dir / "report.json").read_text())
    assert report["resumed_from_step"] == 16 and report["steps"] == 32
    assert report["strategy_choice"] == made and report["strategy"] == made["settings"]["name"]
    assert len({p["model_sha256"] for p in report["per_rank"]}) == 1
