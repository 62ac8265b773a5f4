"""`vpscluster train` as a user runs it: bad input, the run directory, the report, events."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import run_cli
from vpscluster.train.events import format_event, parse_event

CONTRACT_KEYS = {
    "strategy", "world_size", "steps", "tokens", "wall_seconds", "tokens_per_s", "compute_seconds",
    "comm_seconds", "compute_utilization", "final_train_loss", "final_val_loss", "bytes_sent",
}
STEP_KEYS = {"step", "loss", "step_seconds", "compute_seconds", "comm_seconds", "tokens", "bytes_sent"}


def _bad(tmp_path: Path) -> list[tuple[list[str], str]]:
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("max_steps: [1,\n")
    unknown = tmp_path / "unknown.yaml"
    unknown.write_text("max_stepz: 10\n")
    wrong_type = tmp_path / "type.yaml"
    wrong_type.write_text("strategy:\n  compress: zip\n")
    (tmp_path / "empty").mkdir()
    (tmp_path / "tiny.txt").write_text("too short")
    return [
        (["--max-steps", "-5"], "max_steps must be at least 1"),
        (["--preset", "huge"], "unknown preset 'huge'"),
        (["--preset", "7b"], "planning only"),
        (["--data", str(tmp_path / "missing.txt")], "no such file or folder"),
        (["--data", str(tmp_path / "empty")], "no text files"),
        (["--data", str(tmp_path / "tiny.txt")], "too few"),
        (["--nodes", "1000"], "would thrash"),
        (["--nodes", "0"], "nodes must be at least 1"),
        (["--time-budget", "-3"], "time_budget must be a positive"),
        (["--config", str(bad_yaml)], "not valid YAML at line"),
        (["--config", str(unknown)], "unknown key 'max_stepz'"),
        (["--config", str(wrong_type)], "strategy.compress: 'zip' is not one of"),
        (["--config", str(tmp_path / "nope.yaml")], "cannot read it"),
        (["--resume", str(tmp_path / "empty")], "not a run directory"),
        (["--max-restarts", "-1"], "recovery.max_restarts and min_nodes must not be negative"),
        (["--min-nodes", "3"], "--min-nodes 3 is more than the 1 node of this machine"),
    ]


def test_bad_input_one_line_no_traceback(tmp_path):
    for args, expected in _bad(tmp_path):
        run_dir = [] if args[0] == "--resume" else ["--run-dir", str(tmp_path / "run")]
        r = run_cli("train", *run_dir, *args, timeout=60)
        lines = r.stderr.strip().splitlines()
        assert r.returncode != 0, args
        assert "Traceback" not in r.stderr, (args, r.stderr)
        assert len(lines) == 1 and expected in lines[0], (args, r.stderr)
        assert r.stdout == ""
        assert not (tmp_path / "run" / "config.yaml").exists()  # nothing started


def test_resume_refuses_config_changes(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("max_steps: 5\n")
    r = run_cli("train", "--resume", str(run), "--preset", "small", "--lr", "0.1", timeout=60)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert "drop --lr, --preset" in r.stderr.strip()


def test_events_round_trip():
    line = format_event("step", step=3, loss=2.5)
    assert parse_event(line) == {"event": "step", "step": 3, "loss": 2.5}
    assert parse_event("[rank0]: " + line)["step"] == 3
    assert parse_event("ordinary log line") is None
    assert parse_event("VPSC_EVENT {broken") is None
    with pytest.raises(ValueError):
        format_event("nonsense")


@pytest.mark.slow
def test_train_end_to_end(tmp_path):
    run = tmp_path / "run"
    r = run_cli("train", "--json", "--max-steps", "30", "--eval-every", "15", "--checkpoint-every", "15",
                "--run-dir", str(run), timeout=400)
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads(r.stdout)  # stdout is exactly one JSON document
    assert CONTRACT_KEYS <= set(report)
    assert report == json.loads((run / "report.json").read_text())
    assert report["strategy"] == "ddp" and report["world_size"] == 2 and report["steps"] == 30
    assert report["tokens"] == 30 * 2 * 16 * 128
    assert report["initial_val_loss"] > 5.4
    assert report["final_val_loss"] < 3.0
    assert len(report["bytes_sent"]) == 2 and all(b > 0 for b in report["bytes_sent"])
    assert 0 < report["compute_utilization"] <= 1
    assert report["compute_seconds"] + report["comm_seconds"] <= report["wall_seconds"] * 1.01
    # DDP keeps the replicas identical: every rank ends with the same weights (hashed on each rank).
    assert [r["model_sha256"] for r in report["per_rank"]] == [report["model_sha256"]] * 2
    # the run directory
    assert {"config.yaml", "metrics.jsonl", "checkpoints", "logs", "report.json"} <= {p.name for p in run.iterdir()}
    # the preset's default lr is written down, so a resume keeps it whatever the default becomes
    assert "\nlr: 0.003\n" in "\n" + (run / "config.yaml").read_text()
    lines = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [l for l in lines if "loss" in l]
    assert [l["step"] for l in steps] == list(range(1, 31)) and all(STEP_KEYS <= set(l) for l in steps)
    assert [l["step"] for l in lines if "val_loss" in l] == [0, 15, 30]
    assert sum(l["bytes_sent"] for l in steps) == report["bytes_sent"][0]
    for step in (15, 30):
        d = run / "checkpoints" / f"step-{step:08d}"
        assert {p.name for p in d.iterdir()} == {"manifest.json", "rank-00000.pt", "rank-00001.pt"}
    assert {"rank-0.log", "rank-1.log", "launcher.log"} <= {p.name for p in (run / "logs").iterdir()}
    assert "validation loss" in r.stderr  # progress went to stderr


@pytest.mark.slow
def test_time_budget_stops_all_ranks_with_checkpoint(tmp_path):
    run = tmp_path / "run"
    r = run_cli("train", "--json", "--time-budget", "3", "--max-steps", "100000", "--batch-size", "4",
                "--run-dir", str(run), timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads(r.stdout)
    assert report["stopped_by"] == "time_budget"
    assert 1 <= report["steps"] < 100000
    assert 3 <= report["wall_seconds"] < 60
    assert (run / "checkpoints" / f"step-{report['steps']:08d}" / "manifest.json").exists()
    # the budget agreement is communication too: counted on both ranks
    assert all(b > 0 for b in report["bytes_sent"])


@pytest.mark.slow
def test_interrupt_stops_every_process(tmp_path):
    run = tmp_path / "run-interrupt"
    proc = subprocess.Popen(
        [sys.executable, "-m", "vpscluster", "train", "--max-steps", "100000", "--run-dir", str(run)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    try:
        deadline = time.monotonic() + 120
        metrics = run / "metrics.jsonl"
        while time.monotonic() < deadline and not (metrics.exists() and '"loss"' in metrics.read_text()):
            time.sleep(0.2)
        assert metrics.exists(), "training did not start"
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err
    assert "interrupted" in err and "Traceback" not in err
    time.sleep(0.5)
    assert _processes_mentioning(str(run)) == []


def _processes_mentioning(text: str) -> list[int]:
    found = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if text in cmd:
                found.append(int(pid))
    return found


@pytest.mark.slow
def test_dead_rank_fails_fast_with_one_line_and_nothing_left(tmp_path):
    """kill -9 one worker mid-training: the launcher stops the job and says where the logs are."""
    run = tmp_path / "run-dead"
    proc = subprocess.Popen(
        [sys.executable, "-m", "vpscluster", "train", "--max-steps", "100000", "--run-dir", str(run)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    try:
        deadline = time.monotonic() + 120
        metrics = run / "metrics.jsonl"
        while time.monotonic() < deadline and not (metrics.exists() and '"loss"' in metrics.read_text()):
            time.sleep(0.2)
        victims = [pid for pid in _processes_mentioning(str(run)) if _env(pid).get("RANK") == "1"]
        assert len(victims) == 1, "rank 1 worker not found"
        os.kill(victims[0], signal.SIGKILL)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, err
    lines = [l for l in err.splitlines() if "error:" in l]
    assert len(lines) == 1 and "training failed: local rank 1 was killed by SIGKILL" in lines[0], err
    assert str(run / "logs") in lines[0]
    assert "Traceback" not in err
    time.sleep(0.5)
    assert _processes_mentioning(str(run)) == []


def _env(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(kv.split("=", 1) for kv in raw.decode(errors="replace").split("\0") if "=" in kv)
