"""DiLoCo's ranks agree on every outer sync's outcome, and the loop compares replicas at checkpoints.

A sync can fail on one rank only: its collective completes on rank 0 while rank 1 gives up on it
(a time-out firing just as the last chunk arrives). Here rank 1's pseudo-gradient all-reduce
runs for real and then fails on rank 1 alone (a fault hook in that rank's process). Without the
agreement rank 0 applied the outer update and rank 1 skipped it, and the replicas went on
different; with it both skip the round (or retry it) alike. Real gloo ranks, blocking and
overlapped syncs.

At every checkpoint the trainer all-gathers a hash of the replicated state; replicas that differ
stop the run before the checkpoint is written (the last checkpoint stands).
"""

from __future__ import annotations

import os

import pytest

from test_diloco_overlap import run_trainer_ranks
from test_diloco_strategy import digest, flat, make_model, make_strategy, run_ranks, train_step

H = 3


def _fail_on_rank1(rank, call_to_fail):
    """Rank 1's `call_to_fail`-th pseudo-gradient all-reduce completes (on every rank) and then
    raises on rank 1 only, as a collective that timed out there would."""
    from vpscluster.train.strategies import diloco

    real = getattr(diloco.all_reduce_sum, "real", diloco.all_reduce_sum)
    calls = [0]

    def flaky(*args, **kwargs):
        out = real(*args, **kwargs)
        calls[0] += 1
        if rank == 1 and calls[0] == call_to_fail:
            raise RuntimeError("injected: the pseudo-gradient all-reduce timed out on rank 1 only")
        return out

    flaky.real = real
    diloco.all_reduce_sum = flaky


def _state(strategy):
    return {"global": [digest(g) for g in strategy.global_flat], "momentum": [digest(m) for m in strategy.momentum],
            "outer_steps": strategy.outer_steps, "fragment_syncs": list(strategy.fragment_syncs),
            "steps_since_sync": list(strategy.steps_since_sync), "syncs_failed": strategy.syncs_failed,
            "syncs_retried": strategy.syncs_retried}


def _skipped(rank, world, tau):
    """Two rounds; the second sync fails on rank 1 only and there is no retry: the state just
    after it lands (no further sync, so the unfixed code can get this far without hanging)."""
    import torch

    _fail_on_rank1(rank, 2)
    model = make_model()
    strategy = make_strategy(rank, world, sync_every=H, overlap_steps=tau, sync_retries=0)
    model = strategy.setup(model)
    opt = torch.optim.AdamW(model.parameters(), lr=0.02)
    for step in range(1, 2 * H + tau + 1):
        train_step(model, opt, strategy, rank, step)
    state = _state(strategy)
    state["disagreed"] = strategy.describe().get("syncs_disagreed")
    strategy.close()
    return state


def _retried(rank, world, tau):
    """Three rounds and the end of the run; the second sync fails on rank 1 only and is retried."""
    import torch

    _fail_on_rank1(rank, 2)
    model = make_model()
    strategy = make_strategy(rank, world, sync_every=H, overlap_steps=tau, sync_retries=1)
    model = strategy.setup(model)
    opt = torch.optim.AdamW(model.parameters(), lr=0.02)
    last = 3 * H + 1
    for step in range(1, last + 1):
        train_step(model, opt, strategy, rank, step)
    strategy.finalize(last)
    state = {**_state(strategy), "local": digest(flat(model)), "replica": strategy.replica_sha256()}
    strategy.close()
    return state


def _cases(rank, world, fn):
    return [fn(rank, world, tau) for tau in (0, 1)]


def test_a_sync_that_fails_on_one_rank_is_skipped_on_every_rank():
    for tau, (r0, r1) in zip((0, 1), zip(*run_ranks(_cases, 2, _skipped))):
        d0, d1 = r0.pop("disagreed"), r1.pop("disagreed")
        assert r0 == r1, f"tau={tau}: the replicas differ after a sync that failed on rank 1 only:\n{r0}\n{r1}"
        assert r0["outer_steps"] == 1 and r0["syncs_failed"] == 1, (tau, r0)
        assert r0["steps_since_sync"] == [H + tau], (tau, r0)  # the skipped round rides on the next sync
        assert (d0, d1) == (1, 0), tau  # rank 0's collective had completed: it gave the update up


def test_a_retry_after_a_failure_on_one_rank_runs_on_every_rank_and_ends_identical():
    for tau, (r0, r1) in zip((0, 1), zip(*run_ranks(_cases, 2, _retried))):
        assert r0 == r1, f"tau={tau}:\n{r0}\n{r1}"
        assert r0["syncs_retried"] == 1 and r0["syncs_failed"] == 0, (tau, r0)
        assert r0["outer_steps"] == 4, (tau, r0)  # 3 rounds and finalize's sync of the last step


# -- replicas compared at checkpoints ---------------------------------------------------------


def _diverging_trainer(rank, world, port, run_dir):
    from vpscluster.errors import UserError
    from vpscluster.train.config import StrategyConfig, TrainConfig
    from vpscluster.train.strategies.diloco import DiLoCoStrategy
    from vpscluster.train.trainer import Trainer

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if rank == 1:  # rank 1's global weights drift after step 5 (as an update applied on one rank only would)
        inner = DiLoCoStrategy.step

        def drifting_step(self, optimizer, step):
            inner(self, optimizer, step)
            if step == 5:
                self.global_flat[0][0] += 1.0

        DiLoCoStrategy.step = drifting_step
    cfg = TrainConfig(preset="tiny", max_steps=8, eval_every=10**6, checkpoint_every=4, eval_batches=1, batch_size=2,
                      exporters=False, threads_per_rank=1, strategy=StrategyConfig(name="diloco", sync_every=2))
    trainer = Trainer(cfg, run_dir, backend="gloo")
    try:
        trainer.train(resume=False)
        return {"step": trainer.step, "error": None}
    except UserError as e:
        return {"step": trainer.step, "error": str(e)}
    finally:
        trainer.close()


@pytest.mark.slow  # a few seconds on a quiet machine; start-up (spawn, imports, data) dominates
def test_replicas_that_differ_stop_the_run_before_the_checkpoint_is_written(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    results = run_trainer_ranks(_diverging_trainer, 2, str(run_dir))
    for r in results:
        assert r["step"] == 8 and r["error"] and "the replicas differ across ranks" in r["error"], r
    steps = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert steps == ["step-00000004"], steps  # agreed at step 4; step 8's checkpoint was not written
