"""Resume equivalence through the CLI: k steps + --resume to N == N steps uninterrupted.

Same losses at every step, same model AND optimizer hashes at N; and when the latest checkpoint
is corrupt, the resume falls back to the previous good one and still ends identical.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from conftest import run_cli

N, K = 12, 8


def _train(*args: str) -> dict:
    r = run_cli("train", "--json", *args, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return {"report": json.loads(r.stdout), "stderr": r.stderr}


def _losses(run: Path) -> dict[int, float]:
    lines = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
    return {l["step"]: l["loss"] for l in lines if "loss" in l}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("resume")
    config = base / "config.yaml"
    # The LR horizon is fixed at N for both runs (a fresh run would fix it at its own max_steps).
    config.write_text(f"lr_decay_steps: {N}\nwarmup_steps: 3\nbatch_size: 4\ncheckpoint_every: 4\neval_every: 100\n")
    full = _train("--config", str(config), "--max-steps", str(N), "--run-dir", str(base / "full"))
    _train("--config", str(config), "--max-steps", str(K), "--run-dir", str(base / "part"))
    shutil.copytree(base / "part", base / "corrupt")
    resumed = _train("--resume", str(base / "part"), "--max-steps", str(N))
    # flip bytes in the middle of rank 1's shard of the latest checkpoint (step K)
    shard = base / "corrupt" / "checkpoints" / f"step-{K:08d}" / "rank-00001.pt"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2 : len(data) // 2 + 8] = b"\xff" * 8
    shard.write_bytes(bytes(data))
    fallback = _train("--resume", str(base / "corrupt"), "--max-steps", str(N))
    return base, full, resumed, fallback


@pytest.mark.slow
def test_resume_equals_uninterrupted(runs):
    base, full, resumed, _ = runs
    assert resumed["report"]["resumed_from_step"] == K
    assert _losses(base / "part") == _losses(base / "full")  # every step, the resumed ones included
    assert len(_losses(base / "full")) == N
    for key in ("model_sha256", "optimizer_sha256", "steps", "tokens", "final_val_loss", "bytes_sent"):
        assert resumed["report"][key] == full["report"][key], key


@pytest.mark.slow
def test_corrupt_latest_checkpoint_falls_back(runs):
    base, full, _, fallback = runs
    warnings = [l for l in fallback["stderr"].splitlines() if "warning:" in l]
    assert len(warnings) == 1, fallback["stderr"]
    assert f"checkpoint step {K} is unusable" in warnings[0] and "resuming from step 4" in warnings[0]
    assert "Traceback" not in fallback["stderr"]
    assert fallback["report"]["resumed_from_step"] == 4
    assert _losses(base / "corrupt") == _losses(base / "full")
    assert fallback["report"]["model_sha256"] == full["report"]["model_sha256"]
    assert fallback["report"]["optimizer_sha256"] == full["report"]["optimizer_sha256"]
    # the corrupt checkpoint is kept aside, not deleted
    aside = [p.name for p in (base / "corrupt" / "checkpoints").iterdir() if ".abandoned-" in p.name]
    assert aside and aside[0].startswith(f"step-{K:08d}")
