"""A run goes on without a lost node: `train --resume RUN --nodes 2` from a checkpoint of 3 ranks.

The checkpoint is re-cut for the ranks present (train/checkpoint.py, `ShardSampler`,
`Strategy.reshard_state`): no step is thrown away, the weights are the checkpoint's (the first
resumed step's loss continues the curve, far below the untrained model's), the replicas stay
identical, and DiLoCo's sync that was in flight at the checkpoint rides on the next one.
"""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.slow

K, N = 8, 16


def _train(cli, *args):
    proc = cli("train", *args, "--json", timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout), proc.stderr


def _metric(run_dir, key: str) -> dict[int, float]:
    lines = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {l["step"]: l[key] for l in lines if key in l}


def _losses(run_dir) -> dict[int, float]:
    return _metric(run_dir, "loss")


@pytest.mark.parametrize("strategy", [
    ["--strategy", "ddp"],
    ["--strategy", "diloco", "--sync-every", "4", "--overlap-steps", "1", "--wire-dtype", "bf16"],
], ids=["ddp", "diloco-overlap"])
def test_three_rank_checkpoint_resumes_on_two(cli, tmp_path, strategy):
    config = tmp_path / "c.yaml"
    config.write_text(f"lr_decay_steps: {N}\nwarmup_steps: 2\nbatch_size: 4\ncheckpoint_every: 4\n"
                      "eval_every: 100\neval_batches: 2\n")
    run = tmp_path / "run"
    first, _ = _train(cli, "--nodes", "3", *strategy, "--config", str(config), "--max-steps", str(K),
                      "--run-dir", str(run))
    assert first["steps"] == K and len(first["per_rank"]) == 3
    resumed, err = _train(cli, "--resume", str(run), "--nodes", "2", "--max-steps", str(N))

    assert resumed["resumed_from_step"] == K and resumed["resumed_from_world_size"] == 3
    assert resumed["steps"] == N and len(resumed["per_rank"]) == 2
    assert f"checkpoint of step {K}, taken on 3 ranks, on 2" in err and "Traceback" not in err
    hashes = {r["model_sha256"] for r in resumed["per_rank"]}
    assert len(hashes) == 1, resumed["per_rank"]  # the two replicas end identical
    losses = _losses(run)
    assert sorted(losses) == list(range(1, N + 1))  # every step once: nothing redone, nothing lost
    # The resumed ranks start from the checkpoint's weights, not from scratch (a median: one small
    # batch's loss is noisy; a restart would repeat steps 1-3's ~5.6, 5.0, 4.5).
    first_resumed = sorted(losses[s] for s in (K + 1, K + 2, K + 3))[1]
    assert first_resumed < losses[1] - 0.5 * (losses[1] - losses[K]), losses
    assert resumed["final_val_loss"] < first["initial_val_loss"]
    # DiLoCo's inner lr is the schedule's times 1/sqrt(replicas): 1/sqrt(3), then 1/sqrt(2) once resumed.
    from vpscluster.train.config import TrainConfig
    from vpscluster.train.trainer import lr_at

    cfg = TrainConfig(lr_decay_steps=N, warmup_steps=2, max_steps=N)
    diloco = "diloco" in strategy
    for step, lr in _metric(run, "lr").items():
        scale = (3 ** -0.5 if step <= K else 2 ** -0.5) if diloco else 1.0
        assert lr == pytest.approx(lr_at(cfg, step) * scale, rel=1e-9), (step, lr)
    log = (run / "logs" / "rank-0.log").read_text().splitlines()
    resume = [json.loads(l.split("VPSC_EVENT ", 1)[1]) for l in log if 'VPSC_EVENT {"event":"resume"' in l]
    assert resume == [{"event": "resume", "step": K, "skipped": [], "world_size": 2, "checkpoint_world_size": 3,
                       "shard": 0, "received": False}]  # rank 0 loaded its own old shard
