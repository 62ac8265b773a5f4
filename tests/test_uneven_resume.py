"""Uneven shares survive a resume: k steps + --resume to N == N steps uninterrupted.

Shares 3:1 of 4 micro-batches (`--speeds 3,1`) without re-balancing, so the shares are fixed and
the runs are comparable bit for bit; the shared data stream's position and the controller's state
come back from the checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import run_cli

N, K = 6, 4


def _train(*args: str) -> dict:
    r = run_cli("train", "--json", *args, timeout=400)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout)


@pytest.mark.slow
def test_uneven_resume_equals_uninterrupted(tmp_path):
    config = tmp_path / "config.yaml"
    config.write_text(f"lr_decay_steps: {N}\nwarmup_steps: 2\nbatch_size: 1\ncheckpoint_every: 2\neval_every: 100\n"
                      "strategy: {micro_batches: 4, speeds: [3, 1]}\n")
    full = _train("--config", str(config), "--nodes", "2", "--max-steps", str(N), "--run-dir", str(tmp_path / "full"))
    _train("--config", str(config), "--nodes", "2", "--max-steps", str(K), "--run-dir", str(tmp_path / "part"))
    resumed = _train("--resume", str(tmp_path / "part"), "--max-steps", str(N))
    assert resumed["resumed_from_step"] == K
    assert full["shares"] == resumed["shares"] == [3, 1]
    for key in ("model_sha256", "optimizer_sha256", "steps", "tokens", "final_val_loss"):
        assert resumed[key] == full[key], key

    def lines(run: Path):
        return [(m["step"], m["loss"], m["shares"]) for m in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
                if "loss" in m]

    assert lines(tmp_path / "part") == lines(tmp_path / "full")
