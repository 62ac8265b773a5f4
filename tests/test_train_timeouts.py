"""Collective time-outs on 2 real gloo processes running the real Trainer.

Start-up (DDP's weight broadcast and shape check) runs under `timeouts.startup_collective_s`,
so a rank that is slow to start does not fail the job; once training runs, the short
`timeouts.train_collective_s` applies, so a stuck peer fails the job in seconds.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from conftest import free_port

TRAIN_TIMEOUT_S = 3.0
STARTUP_TIMEOUT_S = 120.0
SLOW_START_S = 2 * TRAIN_TIMEOUT_S + 2  # longer than the training time-out, far below start-up's
STUCK_S = 20.0  # a peer stuck this long in training must be noticed after about TRAIN_TIMEOUT_S


def _rank(rank: int, port: int, out_dir: str, stuck_at_step: int | None) -> None:
    import torch

    from vpscluster.train import trainer as T
    from vpscluster.train.config import TimeoutConfig, TrainConfig
    from vpscluster.train.strategies.ddp import DDPStrategy

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2")
    torch.set_num_threads(1)
    if rank == 1:  # slow to start: reaches DDP's start-up broadcast late
        setup = DDPStrategy.setup

        def slow_setup(self, model):
            time.sleep(SLOW_START_S)
            return setup(self, model)

        DDPStrategy.setup = slow_setup
        if stuck_at_step is not None:  # then stuck (not dead) in the middle of training
            step = DDPStrategy.step

            def stuck_step(self, opt, n):
                if n == stuck_at_step:  # after this step's all-reduce: rank 0 waits in the next one
                    Path(out_dir, "stuck_since").write_text(str(time.time()))
                    time.sleep(STUCK_S)
                return step(self, opt, n)

            DDPStrategy.step = stuck_step
    cfg = TrainConfig(preset="tiny", max_steps=3, eval_batches=1, checkpoint_every=100, threads_per_rank=1,
                      timeouts=TimeoutConfig(startup_collective_s=STARTUP_TIMEOUT_S, train_collective_s=TRAIN_TIMEOUT_S))
    run_dir = Path(out_dir) / "run"
    run_dir.mkdir(exist_ok=True)
    trainer = T.Trainer(cfg, run_dir, backend="gloo")
    try:
        trainer.train(resume=False)
        result = {"ok": True}
    except Exception as e:  # what the collective raised, as the worker would log it
        result = {"ok": False, "error": f"{type(e).__name__}: {e}"[:400]}
    result["ended_at"] = time.time()
    result["step"] = getattr(trainer, "step", None)
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    os._exit(0)  # a failed gloo group may not tear down cleanly; the result is written


def _run(tmp_path: Path, stuck_at_step: int | None) -> list[dict | None]:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, str(tmp_path), stuck_at_step)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(STARTUP_TIMEOUT_S + 60)
        if p.is_alive():
            p.kill()
        if stuck_at_step is not None:
            # Rank 0's result is all the stuck case asks: rank 1 is not waited for through the
            # rest of its STUCK_S (it has no result; the caller ignores it).
            for q in procs[1:]:
                q.kill()
                q.join(30)
            break
    return [json.loads(path.read_text()) if path.exists() else None
            for path in (tmp_path / f"rank{r}.json" for r in range(2))]


@pytest.mark.timeout(400)
def test_slow_start_uses_the_startup_timeout_and_a_stuck_peer_the_training_one(tmp_path: Path) -> None:
    # A rank that starts SLOW_START_S late (more than the training time-out): the job still trains.
    slow = tmp_path / "slow"
    slow.mkdir()
    r0, r1 = _run(slow, stuck_at_step=None)
    assert r0["ok"] and r1["ok"], (r0, r1)
    assert r0["step"] == r1["step"] == 3

    # The same slow start, then rank 1 stuck for STUCK_S after step 2's all-reduce: rank 0's
    # next collective fails after about TRAIN_TIMEOUT_S, long before the stuck peer wakes
    # (under the start-up time-out it would simply have waited for it).
    stuck = tmp_path / "stuck"
    stuck.mkdir()
    r0, r1 = _run(stuck, stuck_at_step=2)
    assert not r0["ok"] and "timed out" in r0["error"].lower(), r0
    # Rank 0's next collective times out: step 2's stop agreement (a stop may be requested at any
    # step, see trainer.py), or step 3's all-reduce where no agreement runs after step 2.
    assert r0["step"] in (2, 3)
    waited = r0["ended_at"] - float((stuck / "stuck_since").read_text())
    assert TRAIN_TIMEOUT_S - 1 < waited < STUCK_S - 5, (waited, r0)
