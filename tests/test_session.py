"""The session API (`vpscluster.session`) on 2-3 real gloo processes started as a launcher does
(RANK, WORLD_SIZE, MASTER_ADDR/PORT in the environment), with a small user model and loop.

- ddp and diloco (int8 wire, overlapped sync): after `close` every rank's weights are
  bit-identical (hashes compared), and the loss falls.
- diloco's bytes on the wire are about H times fewer than ddp's for the same steps.
- A time budget stops every rank after the same step, a sync point.
- A checkpoint mid-round, then a fresh set of processes resuming it, ends exactly where a
  straight run ends (same hashes, same losses).
- Uneven shares (diloco): the ranks read different numbers of batches and still agree.
- One process without a launcher: everything works, nothing is synchronised.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import traceback

import pytest

from conftest import free_port

TIMEOUT_S = 120


def _entry(fn, rank, world, port, args, queue):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        import torch

        torch.set_num_threads(1)
        queue.put((rank, "ok", fn(rank, world, *args)))
    except BaseException:
        queue.put((rank, "error", traceback.format_exc()))


def run_ranks(fn, world, *args):
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(fn, r, world, port, args, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results = {}
    try:
        for _ in range(world):
            rank, status, value = queue.get(timeout=TIMEOUT_S)
            if status != "ok":
                pytest.fail(f"rank {rank} failed:\n{value}")
            results[rank] = value
    finally:
        for p in procs:
            p.join(timeout=15)
            if p.is_alive():
                p.kill()
    return [results[r] for r in range(world)]


# -- the user's side: a model, a dataset and a loop of their own ----------------------------------


def make_data(n=384):
    """A learnable map-style dataset: 8 features, 3 classes by a fixed linear rule (a list)."""
    import torch

    g = torch.Generator().manual_seed(7)
    x = torch.randn(n, 8, generator=g)
    w = torch.randn(8, 3, generator=g)
    y = (x @ w).argmax(dim=1)
    return [(x[i], y[i]) for i in range(n)]


def make_model(seed):
    import torch
    from torch import nn

    torch.manual_seed(seed)  # a different seed per rank: the session must make them agree
    return nn.Sequential(nn.Linear(8, 256), nn.Tanh(), nn.Dropout(0.1), nn.Linear(256, 3))


def user_loop(rank, world, settings, epochs=2, stop_after=None, save_at=None, step_sleep=0.0):
    """The README's loop. Returns what the test compares."""
    import time

    import torch
    from torch.nn import functional as F

    from vpscluster import session
    from vpscluster.train.checkpoint import state_hash

    s = session.start(**settings)
    assert (s.rank, s.world_size) == (rank, world)
    model = s.setup(make_model(seed=rank))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    resumed = s.resume(opt)
    data = make_data()
    losses, batches = [], 0
    done = False
    for _ in range(epochs):
        for x, y in s.shard(data, batch_size=8):
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            s.step(opt, samples=len(x), loss=loss)
            opt.zero_grad()
            batches += 1
            losses.append(round(loss.item(), 6))
            if step_sleep and rank == world - 1:
                time.sleep(step_sleep)  # one slower rank
            if save_at is not None and s.steps == save_at:
                s.save(opt, extra={"note": "mid-round"})
            if s.should_stop or (stop_after is not None and s.steps == stop_after):
                done = True
                break
        if done:
            break
    report = s.close()
    return {"report": report, "losses": losses, "batches": batches, "steps": s.steps, "resumed": resumed,
            "hash": state_hash(s.strategy.unwrap().state_dict())}


def _hashes(results):
    return {r["hash"] for r in results} | {r["report"]["model_sha256"] for r in results}


def _strategies(rank, world):
    ddp = user_loop(rank, world, {"strategy": {"name": "ddp"}})
    diloco = user_loop(rank, world, {"strategy": {"name": "diloco", "sync_every": 8, "wire_dtype": "int8",
                                                  "overlap_steps": 2}})
    return ddp, diloco


def test_ddp_and_diloco_int8_overlap_end_identical_and_learn():
    results = run_ranks(_strategies, 2)
    ddp, diloco = [r[0] for r in results], [r[1] for r in results]
    for runs, name in ((ddp, "ddp"), (diloco, "diloco")):
        assert len(_hashes(runs)) == 1, f"{name}: ranks ended with different weights"
        rep = runs[0]["report"]
        assert rep["strategy"] == name and rep["world_size"] == 2
        assert rep["steps"] == 2 * (384 // 16) == runs[1]["report"]["steps"]  # two epochs of 24 steps
        assert rep["samples"] == 2 * 384 // 16 * 16
        per_rank = {r["model_sha256"] for r in rep["per_rank"]}
        assert per_rank == _hashes(runs)
        first, last = runs[0]["losses"][:8], runs[0]["losses"][-8:]
        assert sum(last) / 8 < 0.7 * sum(first) / 8, f"{name}: loss did not fall ({first} -> {last})"
    d = diloco[0]["report"]["strategy_details"]
    assert (d["wire_dtype"], d["sync_every"], d["overlap_steps"]) == ("int8", 8, 2)
    assert d["outer_syncs"] == 48 // 8
    # ddp all-reduces fp32 gradients every step; diloco sends int8 once per 8 steps: far more than H x fewer.
    assert diloco[0]["report"]["bytes_sent"][0] * 8 < ddp[0]["report"]["bytes_sent"][0]


def _budget(rank, world, tmp):
    return user_loop(rank, world, {"strategy": {"name": "diloco", "sync_every": 4, "overlap_steps": 1},
                                   "time_budget_s": 1.0, "run_dir": tmp}, epochs=50, step_sleep=0.02)


def test_time_budget_stops_every_rank_after_the_same_sync_point(tmp_path):
    import json

    results = run_ranks(_budget, 3, str(tmp_path))
    steps = {r["steps"] for r in results}
    assert len(steps) == 1, f"ranks stopped at different steps: {steps}"
    step = steps.pop()
    assert step < 50 * 24, "the budget did not stop the run"
    assert (step - 1) % 4 == 0, f"step {step} is not where an outer update lands (sent at 4k, lands at 4k + 1)"
    assert len(_hashes(results)) == 1
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["stopped_by"] == "time_budget" and report["steps"] == step
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == step and json.loads(lines[-1])["step"] == step


DILOCO_RESUME = {"name": "diloco", "sync_every": 4, "wire_dtype": "int8", "overlap_steps": 1}


def _straight(rank, world):
    return user_loop(rank, world, {"strategy": DILOCO_RESUME}, epochs=1, stop_after=18)


def _first_half(rank, world, tmp):
    return user_loop(rank, world, {"strategy": DILOCO_RESUME, "run_dir": tmp}, epochs=1, stop_after=6, save_at=6)


def _second_half(rank, world, tmp):
    return user_loop(rank, world, {"strategy": DILOCO_RESUME, "run_dir": tmp, "resume": True},
                     epochs=1, stop_after=18)


def test_resume_mid_round_equals_a_straight_run(tmp_path):
    straight = run_ranks(_straight, 2)
    first = run_ranks(_first_half, 2, str(tmp_path))
    assert [r["steps"] for r in first] == [6, 6]
    assert (tmp_path / "checkpoints" / "step-00000006").is_dir()
    second = run_ranks(_second_half, 2, str(tmp_path))
    assert [r["resumed"] for r in second] == [{"note": "mid-round"}] * 2
    assert [r["steps"] for r in second] == [18, 18]
    assert second[0]["report"]["resumed_from_step"] == 6
    for rank in range(2):
        assert first[rank]["losses"] + second[rank]["losses"] == straight[rank]["losses"]
    assert _hashes(second) == _hashes(straight) and len(_hashes(straight)) == 1


def _uneven(rank, world):
    return user_loop(rank, world, {"strategy": {"name": "diloco", "sync_every": 4, "overlap_steps": 0,
                                                "micro_batches": 4, "speeds": [3, 1]}}, epochs=1)


def test_uneven_shares_read_more_on_the_faster_rank_and_agree():
    results = run_ranks(_uneven, 2)
    # 4 micro-batches of 8 per step, split 3:1; 384 // 32 = 12 steps for both ranks.
    assert [r["steps"] for r in results] == [12, 12]
    assert [r["batches"] for r in results] == [36, 12]
    assert results[0]["report"]["shares"] == [3, 1]
    assert len(_hashes(results)) == 1


def test_one_process_without_a_launcher(tmp_path, monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "VPSC_SESSION"):
        monkeypatch.delenv(var, raising=False)
    out = user_loop(0, 1, {"strategy": {"name": "diloco", "sync_every": 4}, "run_dir": str(tmp_path)}, epochs=1)
    rep = out["report"]
    assert (rep["world_size"], rep["steps"], rep["bytes_sent"]) == (1, 384 // 8, [0])
    assert rep["strategy_details"]["overlap_steps"] == 0  # nothing on the wire to overlap with
    assert (tmp_path / "report.json").is_file()
    assert out["losses"][-1] < out["losses"][0]


def test_threads_per_rank_sets_torchs_threads(monkeypatch):
    """`run --threads-per-rank N` reaches the script as session.json's key (and OMP_NUM_THREADS,
    test_launch_commands.py); `session.start` sets torch's intra-op threads from it."""
    import torch

    from vpscluster import session

    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "VPSC_SESSION"):
        monkeypatch.delenv(var, raising=False)
    before = torch.get_num_threads()
    want = 1 if before != 1 else 2
    try:
        s = session.start(threads_per_rank=want)
        assert torch.get_num_threads() == want and s.world_size == 1
    finally:
        torch.set_num_threads(before)


def test_shard_splits_each_epoch_anew_and_covers_every_sample_once():
    from vpscluster.session.config import SessionConfig

    class Fake:  # two ranks' views of one session position, without processes
        def __init__(self, rank):
            self.rank, self.cfg, self._data, self._micro = rank, SessionConfig(), {"epoch": 0, "index": 0}, (0, 1)

        def _shares(self):
            return [1, 1]

        def _shard_index(self):
            return self.rank

    from vpscluster.session.shard import ShardLoader

    data = list(range(50))
    epochs = []
    views = [Fake(0), Fake(1)]
    for _ in range(2):
        seen = [sorted(int(v) for b in ShardLoader(f, data, 4, None) for v in b) for f in views]
        assert not set(seen[0]) & set(seen[1])
        assert len(seen[0]) == len(seen[1]) == 24  # 50 // 8 = 6 steps of 4 each; 2 left out
        epochs.append(seen)
    assert epochs[0] != epochs[1]  # a new order each epoch


def test_a_checkpoint_of_an_epochs_last_step_resumes_at_the_next_epoch():
    """During an epoch's last step the position already names the next epoch (what a checkpoint
    of that step stores and `Session.epoch` says), so `for e in range(s.epoch, epochs)` after a
    resume trains no epoch twice; a break mid-epoch goes on where it stopped."""
    from vpscluster.session.config import SessionConfig
    from vpscluster.session.shard import ShardLoader

    class Fake:
        def __init__(self):
            self.rank, self.cfg, self._data, self._micro = 0, SessionConfig(), {"epoch": 0, "index": 0}, (0, 1)

        def _shares(self):
            return [1]

        def _shard_index(self):
            return 0

    f = Fake()
    seen = []
    for batch in ShardLoader(f, list(range(12)), 4, None):  # 3 steps an epoch
        seen.append(dict(f._data))
    assert seen == [{"epoch": 0, "index": 1, "sample": 4}, {"epoch": 0, "index": 2, "sample": 8},
                    {"epoch": 1, "index": 0, "sample": 0}]
    loader = ShardLoader(f, list(range(12)), 4, None)
    for batch in loader:
        break
    assert f._data == {"epoch": 1, "index": 1, "sample": 4}
    assert len(list(loader)) == 2 and f._data == {"epoch": 2, "index": 0, "sample": 0}  # the rest of epoch 1, once
    old = Fake()
    old._data = {"epoch": 0, "index": 3}  # a checkpoint written before this rule: the epoch had ended
    assert len(list(ShardLoader(old, list(range(12)), 4, None))) == 3 and old._data == {"epoch": 2, "index": 0,
                                                                                         "sample": 0}
    older = Fake()
    older._data = {"epoch": 0, "index": 1}  # and one from before positions in samples, mid-epoch: steps of 4
    assert [list(map(int, b)) for b in ShardLoader(older, list(range(12)), 4, None)] == \
        [list(map(int, b)) for b in list(ShardLoader(Fake(), list(range(12)), 4, None))[1:]]


def test_a_session_under_vpscluster_run_announces_its_step_now_and_then(tmp_path, monkeypatch):
    """Under `vpscluster run` (VPSC_SESSION set) rank 0 writes a `step` event at most every
    STEP_EVENT_S (the launcher's recovery record reads them); plain `python` writes none."""
    import io
    import json
    import time

    import torch

    from vpscluster import session
    from vpscluster.session.config import ENV, SessionConfig, write
    from vpscluster.session.core import STEP_EVENT_S
    from vpscluster.train.events import EventWriter, parse_event

    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", ENV):
        monkeypatch.delenv(var, raising=False)
    assert session.start().step_events_s is None
    monkeypatch.setenv(ENV, str(write(SessionConfig(), tmp_path)))
    s = session.start()
    assert s.step_events_s == STEP_EVENT_S
    out = io.StringIO()
    s.events = EventWriter(out)
    model = s.setup(torch.nn.Linear(2, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for i in range(6):
        model(torch.ones(1, 2)).sum().backward()
        s.step(opt, samples=1, loss=torch.tensor(float(i)))
        opt.zero_grad()
        if i == 2:
            time.sleep(STEP_EVENT_S + 0.05)
    s.close()
    steps = [e["step"] for e in map(parse_event, out.getvalue().splitlines()) if e and e["event"] == "step"]
    # The first step, then the first after the pause; not every step (they take microseconds here).
    assert steps[0] == 1 and 4 in steps and len(steps) < 6, out.getvalue()
    assert json.loads(out.getvalue().splitlines()[0].split(" ", 1)[1])["loss"] == 0.0
