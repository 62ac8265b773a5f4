"""DiLoCo through the real trainer: stopping mid-round and resuming gives the uninterrupted result.

`vpscluster train --nodes 2 --strategy diloco --sync-every 4 --max-steps 12` against the same run
stopped at step 6 (mid-round: finalize syncs, a checkpoint is written) and continued with
`--resume RUN_DIR --max-steps 12`. The final model and optimizer hashes must be identical.
"""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.slow

COMMON = ["--nodes", "2", "--strategy", "diloco", "--sync-every", "4", "--wire-dtype", "int8", "--fragments", "2"]


def _train(cli, *args):
    proc = cli("train", *args, "--json", timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


def test_resume_mid_round_through_the_trainer_equals_an_uninterrupted_run(cli, tmp_path):
    config = tmp_path / "small_eval.yaml"
    # The LR schedule's horizon is fixed at 12 for both runs (otherwise the first run's
    # --max-steps 6 would become it); few, small batches keep the test quick.
    config.write_text("lr_decay_steps: 12\neval_batches: 2\nbatch_size: 4\neval_every: 4\n")
    straight = _train(cli, *COMMON, "--config", str(config), "--max-steps", "12", "--run-dir", str(tmp_path / "straight"))
    first = _train(cli, *COMMON, "--config", str(config), "--max-steps", "6", "--run-dir", str(tmp_path / "resumed"))
    resumed = _train(cli, "--resume", str(tmp_path / "resumed"), "--max-steps", "12")

    assert first["steps"] == 6 and resumed["steps"] == straight["steps"] == 12
    assert resumed["resumed_from_step"] == 6
    # The stopped run ended on synced weights that differ from where the full run goes.
    assert first["model_sha256"] != straight["model_sha256"]
    assert resumed["model_sha256"] == straight["model_sha256"]
    assert resumed["optimizer_sha256"] == straight["optimizer_sha256"]
    assert resumed["final_val_loss"] == straight["final_val_loss"]
    # Validation due at steps 4 and 8 ran where the next outer update landed (H = 4, two
    # fragments: sends every 2 steps, landing τ = 1 later), on the global weights, then at the end.
    evals = [json.loads(line) for line in (tmp_path / "straight" / "metrics.jsonl").read_text().splitlines()
             if "val_loss" in line]
    assert [e["step"] for e in evals] == [0, 5, 9, 12]
    # Both ranks sent pseudo-gradients (counted by the strategy).
    assert all(b > 0 for b in straight["bytes_sent"])
