"""Overlapped DiLoCo outer syncs and the time budget agreed at sync points, on 2 real gloo ranks.

- With overlap τ every rank holds the same θ_global after every sync, the update lands exactly τ
  steps after the send, and `finalize` leaves identical weights everywhere.
- The documented delay, from the math: with inner updates that do not depend on the weights
  (each rank adds fixed increments), the pseudo-gradients of the overlapped run are exactly those
  of the blocking run, so θ_global at step t with overlap τ equals θ_global at step t − τ without.
- A checkpoint with a sync in flight (and one written after `finalize`) resumes bit-exactly.
- Through the real trainer, with one rank slower: a time budget stops every rank after the same
  step, a sync point, and nothing is communicated at the steps in between.
"""

from __future__ import annotations

import copy
import json
import os

import pytest

from conftest import free_port
from test_diloco_strategy import digest, flat, make_model, run_ranks, train_step

H = 4


def make_strategy(rank, world, **overrides):
    from vpscluster.train.config import StrategyConfig
    from vpscluster.train.strategies.base import DistContext
    from vpscluster.train.strategies.diloco import DiLoCoStrategy

    cfg = StrategyConfig(name="diloco", **overrides)
    return DiLoCoStrategy(cfg, DistContext(rank=rank, world_size=world))


def fragment_digests(strategy):
    import torch

    return [digest(torch.cat([p.detach().reshape(-1) for p in ps])) for ps in strategy.fragment_params]


def test_overlap_setting_is_checked_and_capped_below_h():
    from vpscluster.errors import UserError
    from vpscluster.train.config import StrategyConfig

    with pytest.raises(UserError, match="overlap_steps"):
        StrategyConfig(name="diloco", overlap_steps=-1)
    assert make_strategy(0, 2, sync_every=4, overlap_steps=10).overlap == 3  # never sent again before it lands
    assert make_strategy(0, 2, sync_every=1).overlap == 0  # H = 1: nothing to overlap with
    assert make_strategy(0, 1, sync_every=4, overlap_steps=2).overlap == 0  # one rank: nothing on the wire


# -- agreement and timing with overlap ------------------------------------------------------------


def _overlap_agreement(rank, world, tau, wire_dtype, fragments):
    import torch

    model = make_model()
    strategy = make_strategy(rank, world, sync_every=H, overlap_steps=tau, wire_dtype=wire_dtype, fragments=fragments)
    model = strategy.setup(model)
    opt = torch.optim.AdamW(model.parameters(), lr=0.02)
    log = []  # per step: outer syncs landed so far, θ_global digests, local digests
    for step in range(1, 3 * H + 2):
        train_step(model, opt, strategy, rank, step)
        log.append((strategy.outer_steps, [digest(g) for g in strategy.global_flat], fragment_digests(strategy)))
    strategy.finalize(3 * H + 1)
    end = (fragment_digests(strategy), [digest(g) for g in strategy.global_flat])
    busy = strategy.collective_busy_seconds
    seconds, nbytes = strategy.comm.take()
    strategy.close()
    return log, end, nbytes, busy


OVERLAP_CASES = [(1, "fp32", 1), (H - 1, "int8", 1), (2, "bf16", 2)]


def _overlap_cases(rank, world):
    return [_overlap_agreement(rank, world, *case) for case in OVERLAP_CASES]


@pytest.mark.parametrize("tau,wire_dtype,fragments", OVERLAP_CASES)
def test_overlapped_syncs_agree_on_every_rank_and_land_tau_steps_late(scenarios, tau, wire_dtype, fragments):
    from vpscluster.train.strategies.diloco import sync_offset

    rank0, rank1 = (dict(zip(OVERLAP_CASES, r))[(tau, wire_dtype, fragments)] for r in scenarios["agreement"])
    (log0, end0, bytes0, busy0), (log1, end1, bytes1, busy1) = rank0, rank1
    sends = sorted((s, f) for f in range(fragments) for s in range(1, 3 * H + 2) if s % H == sync_offset(f, fragments, H))
    for step, ((outer0, global0, local0), (outer1, global1, local1)) in enumerate(zip(log0, log1), start=1):
        assert global0 == global1, f"θ_global differs between ranks at step {step}"
        landed = sum(1 for s, _ in sends if s + tau <= step)
        assert outer0 == outer1 == landed, f"step {step}: {outer0} syncs landed, expected {landed}"
    # θ_global changes exactly at the landing steps, never at the send steps.
    changed = [step for step in range(2, len(log0) + 1) if log0[step - 1][1] != log0[step - 2][1]]
    assert changed == sorted({s + tau for s, _ in sends if s + tau <= len(log0)})
    # After landing, each rank keeps its own progress since the send: the ranks still differ...
    assert any(l0 != l1 for (_, _, l0), (_, _, l1) in zip(log0, log1))
    # ...until finalize flushes everything: identical weights, equal to θ_global.
    assert end0 == end1 and end0[0] == end0[1]
    assert bytes0 > 0 and bytes1 > 0 and busy0 > 0 and busy1 > 0


# -- the documented delay, from the math ---------------------------------------------------------


class AddIncrements:
    """An inner 'optimizer' whose step adds a fixed, per-rank, per-step increment to the weights:
    its updates do not depend on the weights, so the pseudo-gradients can be written down."""

    def __init__(self, model, rank):
        self.model, self.rank, self.t = model, rank, 0

    def step(self):
        import torch

        self.t += 1
        g = torch.Generator().manual_seed(100 * self.rank + self.t)
        with torch.no_grad():
            for p in self.model.parameters():
                p.add_(torch.randn(p.shape, generator=g) * 0.01)


def _delay_run(rank, world, tau, fragments):
    model = make_model()
    strategy = make_strategy(rank, world, sync_every=H, overlap_steps=tau, fragments=fragments, outer_lr=0.7,
                             outer_momentum=0.9)
    model = strategy.setup(model)
    opt = AddIncrements(model, rank)
    globals_ = []
    for step in range(1, 4 * H + 1):
        strategy.tokens_processed(300 if rank == 0 else 100)  # uneven weights too
        strategy.step(opt, step)
        globals_.append([g.clone() for g in strategy.global_flat])
    strategy.state_dict()  # waits for the last send's reduction, so no rank leaves while it runs
    strategy.close()
    return globals_


def _delay(rank, world):
    return {(tau, fragments): _delay_run(rank, world, tau, fragments) for tau in (0, 2) for fragments in (1, 2)}


@pytest.mark.parametrize("fragments", [1, 2])
def test_overlap_equals_the_blocking_run_delayed_by_tau(scenarios, fragments):
    import numpy as np

    tau = 2
    for runs in scenarios["delay"]:
        blocking, overlapped = runs[(0, fragments)], runs[(tau, fragments)]
        for t in range(1, len(blocking) + 1):
            late = blocking[t - tau - 1] if t > tau else None
            for f in range(fragments):
                if late is None:
                    np.testing.assert_array_equal(overlapped[t - 1][f], overlapped[0][f])
                else:
                    np.testing.assert_allclose(overlapped[t - 1][f], late[f], rtol=0, atol=1e-6,
                                               err_msg=f"fragment {f} at step {t}")
        # and the outer steps really moved θ_global (the comparison is not vacuous)
        assert np.abs(blocking[-1][0] - blocking[0][0]).max() > 1e-3


# -- resume with a sync in flight ----------------------------------------------------------------


def _resume_in_flight(rank, world, stop_at, total, use_finalize, hold=False):
    import threading

    import torch

    def build():
        model = make_model()
        strategy = make_strategy(rank, world, sync_every=H, overlap_steps=2, fragments=2, wire_dtype="int8")
        model = strategy.setup(model)
        return model, strategy, torch.optim.AdamW(model.parameters(), lr=0.02)

    model, strategy, opt = build()
    release = threading.Event()
    for step in range(1, stop_at + 1):
        if hold and step == stop_at:
            # The sync sent at this step queues behind other work that lasts until the state is
            # saved and the strategy closed: on every rank it is still unstarted then, whatever
            # the machine's load (a fixed sleep raced with a slow rank and left one reducing).
            strategy._executor.submit(release.wait, 120.0)
        train_step(model, opt, strategy, rank, step)
    in_flight = len(strategy.in_flight)
    redo = None
    if stop_at < total:
        if use_finalize:
            strategy.finalize(stop_at)
        ckpt = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict(), "strategy": strategy.state_dict()})
        redo = [e["sent"] is not None for e in ckpt["strategy"]["in_flight"]]
        strategy.close()
        release.set()
        model, strategy, opt = build()  # a new process, in effect
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        strategy.load_state_dict(ckpt["strategy"])
        for step in range(stop_at + 1, total + 1):
            train_step(model, opt, strategy, rank, step)
    strategy.finalize(total)
    strategy.close()
    return digest(flat(model)), [digest(g) for g in strategy.global_flat], in_flight, redo


def test_a_checkpoint_saves_every_sync_in_flight_as_sent_even_one_already_done():
    """Ranks finish a collective at slightly different moments: a state that kept the result
    where the reduction happened to be done (and the delta where it was not) made one rank resume
    waiting on a reduction its peer never ran again (CI: gloo send time-outs). Every in-flight
    sync is saved as sent, done or not."""
    from concurrent.futures import Future

    import torch

    from vpscluster.train.strategies.diloco import _InFlight

    strategy = make_strategy(0, 1, sync_every=H, overlap_steps=2)
    strategy.setup(make_model())
    done = Future()
    done.set_result(torch.ones(3))
    running = Future()
    strategy.in_flight = [_InFlight(0, 6, torch.zeros(3), 4, 64.0, done, None, torch.full((3,), 2.0)),
                          _InFlight(0, 7, torch.zeros(3), 4, 64.0, running, None, torch.full((3,), 3.0))]
    saved = strategy.state_dict()["in_flight"]
    assert [e["result"] for e in saved] == [None, None]
    assert [float(e["sent"][0]) for e in saved] == [2.0, 3.0]
    assert strategy.in_flight[0].future is done  # nothing was collected behind the loop's back


def _resumes(rank, world):
    return {
        "straight": _resume_in_flight(rank, world, 13, 13, False),
        "checkpoint": _resume_in_flight(rank, world, 5, 13, False),  # sent at 4, lands at 6
        "running": _resume_in_flight(rank, world, 4, 13, False, hold=True),  # saved while still reducing
        "finalized": _resume_in_flight(rank, world, 7, 13, True),  # sent at 6, lands at 8
    }


@pytest.mark.parametrize("how", ["checkpoint", "running", "finalized"])
def test_resume_with_a_sync_in_flight_equals_an_uninterrupted_run(scenarios, how):
    r0, r1 = scenarios["resume"]
    assert r0["straight"][:2] == r1["straight"][:2]
    assert r0[how][2] == 1  # a sync really was in flight when the state was saved
    if how == "running":  # saved unfinished: the resumed run reduced it again
        assert r0[how][3] == r1[how][3] == [True]
    if how == "finalized":  # finalize waits for it first: its result was saved
        assert r0[how][3] == r1[how][3] == [False]
    assert r0[how][:2] == r0["straight"][:2] and r1[how][:2] == r1["straight"][:2]


def _all_scenarios(rank, world):
    return {"agreement": _overlap_cases(rank, world), "delay": _delay(rank, world), "resume": _resumes(rank, world)}


@pytest.fixture(scope="module")
def scenarios():
    rank0, rank1 = run_ranks(_all_scenarios, 2)
    return {key: [rank0[key], rank1[key]] for key in rank0}


# -- time budget through the trainer, one rank slower ----------------------------------------------


H_BUDGET = 3


def _budget_rank(rank, world, port, run_dir, tau):
    import threading
    import time

    import torch.distributed as dist

    from vpscluster.train.config import StrategyConfig, TrainConfig
    from vpscluster.train.strategies.diloco import DiLoCoStrategy
    from vpscluster.train.trainer import Trainer

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if rank == 1:  # a slower node: every inner step takes 30 ms longer
        inner = DiLoCoStrategy.step

        def slow_step(self, optimizer, step):
            time.sleep(0.03)
            inner(self, optimizer, step)

        DiLoCoStrategy.step = slow_step
    calls = []  # all-reduces the loop's thread issues (the background syncs use their own thread)
    real_all_reduce = dist.all_reduce

    def counting_all_reduce(*args, **kwargs):
        if threading.current_thread() is threading.main_thread():
            calls.append(1)
        return real_all_reduce(*args, **kwargs)

    dist.all_reduce = counting_all_reduce
    cfg = TrainConfig(preset="tiny", max_steps=100000, time_budget_s=3.0, eval_every=10**6, checkpoint_every=3 * 10**5,
                      eval_batches=1, batch_size=2, exporters=False, threads_per_rank=1,
                      strategy=StrategyConfig(name="diloco", sync_every=H_BUDGET, overlap_steps=tau))
    trainer = Trainer(cfg, run_dir, backend="gloo")
    try:
        report = trainer.train(resume=False)
        return {"step": trainer.step, "report": report, "all_reduces": len(calls)}
    finally:
        trainer.close()


def _trainer_entry(fn, rank, world, port, args, queue):
    import traceback

    try:
        queue.put((rank, "ok", fn(rank, world, port, *args)))
    except BaseException:
        queue.put((rank, "error", traceback.format_exc()))


def run_trainer_ranks(fn, world: int, *args) -> list:
    """Run fn(rank, world, port, *args) in `world` spawned processes that set up torch.distributed
    themselves (as the Trainer does, from RANK/MASTER_PORT); the results in rank order."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_trainer_entry, args=(fn, r, world, port, args, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results = {}
    try:
        for _ in range(world):
            rank, status, value = queue.get(timeout=300)
            if status != "ok":
                pytest.fail(f"rank {rank} failed:\n{value}")
            results[rank] = value
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return [results[r] for r in range(world)]


@pytest.mark.slow  # a few seconds on a quiet machine; start-up (spawn, imports, data) dominates
@pytest.mark.parametrize("tau", [0, 1])
def test_time_budget_stops_every_rank_at_the_same_sync_point(tmp_path, tau):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    results = run_trainer_ranks(_budget_rank, 2, str(run_dir), tau)
    report = results[0]["report"]
    stop = results[0]["step"]
    assert report["stopped_by"] == "time_budget"
    assert results[1]["step"] == stop >= H_BUDGET
    assert (stop - tau) % H_BUDGET == 0  # a sync point: the step an outer update landed
    # Nothing was communicated at the steps between sync points (rank 0 logs every step's bytes;
    # step 1 also carries the set-up's weight check).
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    talked = [line["step"] for line in lines if line.get("bytes_sent") and line["step"] > 1]
    assert talked and all((s - tau) % H_BUDGET == 0 for s in talked), talked
    # The loop's thread issued one budget all-reduce per sync point (plus, without overlap, the
    # blocking syncs' token all-reduce and their agreement on the outcome; with it, finalize's
    # blocking sync of the last step's progress and its agreement), never one per step.
    sync_points = stop // H_BUDGET
    expected = sync_points * 3 if tau == 0 else sync_points + 2
    for r in (0, 1):
        assert results[r]["all_reduces"] == expected, (r, results[r]["all_reduces"], expected, stop)
    assert [p["model_sha256"] for p in report["per_rank"]] == [report["model_sha256"]] * 2
