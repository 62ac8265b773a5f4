"""`--strategy auto` with uneven shares (issues #33, #36 item 4): a session on shares starts as
ddp (one batch a rank, sized by its share, world x B samples a step) and may switch to diloco
(the shares' micro-batches of B, each an inner step) at the end of its measured window; the data
position is kept in samples across the switch (`session/shard.py`), the shares measured under
ddp carry over (`plan.balance.carry_to_diloco`, `session/auto.py`).

- The loader alone (three ranks' views, no processes): a switch mid-epoch reads every sample of
  the epoch's steps exactly once across ranks, and an epoch whose rest holds no diloco step ends
  at the switch.
- The split carried over: fixed shares stay (rounds of H x world / M steps), balanced ones are
  re-chosen for diloco from the speeds, converted to its unit.
- 3 gloo ranks through a user's loop, diloco forced by an egress quota that ddp would overrun
  (the rule's H held at 4 so rounds fall inside the test): shares 3/2/1 fixed, and balanced from
  the measured times with one slow rank; every sample of each epoch seen exactly once (sample
  ids counted), equal weights after close(); a resume from a checkpoint after the switch ends
  bit-identical to the straight run and reads the same samples.
- `run --strategy auto` on uneven nodes decides balancing and says one line.
"""

from __future__ import annotations

import pytest

from test_session import make_data, make_model, run_ranks

H = 4  # the sync rule's H in the gloo tests (see _rule_with_h)
N = 400  # samples: ddp steps of 24 (3 ranks x 8), diloco steps of 48 (6 micro-batches of 8)


# -- the loader, three ranks' views ----------------------------------------------------------------


class _View:
    """One rank's view of a session on shares that switches from ddp to diloco."""

    def __init__(self, rank, ddp_shares):
        from vpscluster.session.config import SessionConfig

        self.rank, self.cfg, self._micro = rank, SessionConfig(), (0, 1)
        self._data = {"epoch": 0, "index": 0, "sample": 0}
        self.weighted, self.shares = True, list(ddp_shares)

    def _shares(self):
        return self.shares

    def _shard_index(self):
        return self.rank

    def _batch_sizes(self, samples):
        from vpscluster.train.shares import batch_sizes

        return batch_sizes(self.shares, samples)

    def _weigh(self, sizes):
        pass


def _epochs(rank, n, switch_at, diloco_shares, epochs=2, b=8):
    """What rank `rank` reads, per epoch of the script's `for e in range(s.epoch, epochs)`."""
    from vpscluster.session.shard import ShardLoader

    v = _View(rank, [3, 2, 1])
    loader = ShardLoader(v, list(range(n)), b, list)
    seen, steps = {}, 0
    while v._data["epoch"] < epochs:
        e = v._data["epoch"]
        it = iter(loader)
        while True:
            k = 1 if v.weighted else v.shares[rank]
            got = [next(it, None) for _ in range(k)]
            if got[0] is None:
                break
            seen.setdefault(e, []).extend(i for batch in got for i in batch)
            steps += 1
            if steps == switch_at:  # what session.auto.switch does to the session and its loader
                v.weighted, v.shares = False, list(diloco_shares)
                loader.settle()
    return seen, steps, dict(v._data)


def _order(n, epoch):
    from vpscluster.session.config import SessionConfig
    from vpscluster.train.data import shard_indices

    return [int(i) for i in shard_indices(n, 0, 1, SessionConfig().seed, epoch)]


@pytest.mark.parametrize("n, epoch0", [(400, 6 * 24 + 5 * 48), (184, 6 * 24)])
def test_a_switch_mid_epoch_reads_every_sample_of_the_epochs_steps_once(n, epoch0):
    # 400: 6 ddp steps (144 samples), then 5 diloco steps of 48, 16 left out; 184: 40 left after
    # the ddp steps, less than a diloco step: the epoch ends at the switch.
    views = [_epochs(r, n, 6, [3, 2, 1]) for r in range(3)]
    assert len({steps for _, steps, _ in views}) == 1  # every rank makes the same steps
    for e, want in ((0, epoch0), (1, n // 48 * 48)):
        ids = [i for seen, _, _ in views for i in seen.get(e, [])]
        assert len(ids) == len(set(ids)) == want, (e, len(ids), len(set(ids)))
        assert set(ids) == set(_order(n, e)[:want])  # the epoch's order, front to back, none skipped
    assert views[0][2] == {"epoch": 2, "index": 0, "sample": 0}


def test_the_split_carries_over_to_diloco():
    from vpscluster.plan.balance import carry_to_diloco, choose_split

    # Fixed shares (balancing off): the same 3/2/1, now micro-batches; rounds of H x 3 / 6 steps.
    c = carry_to_diloco([3.0, 2.0, 1.0], [3, 2, 1], 4, min_round_steps=2, rechoose=False)
    assert (c.micro_batches, c.shares, c.sync_every, c.inner_steps) == (6, (3, 2, 1), 2, 4.0)
    c = carry_to_diloco([3.0, 2.0, 1.0], [3, 2, 1], 10, rechoose=False)
    assert (c.sync_every, c.inner_steps) == (5, 5 * 6 / 3)  # 10 x 3 / 6
    assert carry_to_diloco([1.0, 1.0], [1, 1], 10, 9, rechoose=False).sync_every == 10  # at least a round's steps
    # Balanced: speeds measured under ddp in parts of its step (20 parts of world x B: 6/6/6/2)
    # are 4 / 20 of that in batches of B a second; diloco's split of them keeps H exactly.
    parts_per_s = [12.0, 12.0, 12.0, 4.0]
    c = carry_to_diloco(parts_per_s, [6, 6, 6, 2], 10, min_round_steps=2)
    assert c.speeds == pytest.approx([2.4, 2.4, 2.4, 0.8])
    want = choose_split(c.speeds, None, True, 10, 2)
    assert (c.micro_batches, c.shares, c.sync_every, c.inner_steps) == \
        (want.micro_batches, want.shares, want.sync_every, 10.0) == (20, (6, 6, 6, 2), 2, 10.0)
    even = carry_to_diloco([5.0, 5.0, 5.0], [2, 2, 2], 10)  # measured even: one a rank, rounds of H
    assert (even.micro_batches, even.shares, even.sync_every) == (3, (1, 1, 1), 10)


# -- 3 gloo ranks ----------------------------------------------------------------------------------


def _rule_with_h():
    """The sync rule restricted to H (its `choices`), so a diloco round falls within the test's
    steps; the rule itself (wire, reason, the quota that rules out ddp) runs as in a real run."""
    from vpscluster.train.strategies import sync_rule

    real = sync_rule.choose_measured
    sync_rule.choose_measured = lambda *a, **k: real(*a, **{**k, "choices": (H,)})


def _settings(tmp, name, resume=False, **strategy):
    return {"strategy": {"name": "auto", **strategy}, "run_dir": str(tmp / name), "resume": resume,
            # 1 byte per rank per 30 years: ddp's bytes are over it, so auto chooses diloco
            "auto": {"bandwidth_bytes_s": 1e9, "egress_quotas": [[1.0, 1e9]] * 3, "source": "the test"}}


def _auto_loop(rank, world, settings, epochs=2, save_at=None, slow=0.0):
    import time

    import torch
    from torch.nn import functional as F

    from vpscluster import session
    from vpscluster.train.checkpoint import state_hash

    _rule_with_h()
    s = session.start(**settings)
    model = s.setup(make_model(seed=rank))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    s.resume(opt)
    data = [(x, y, i) for i, (x, y) in enumerate(make_data(N))]
    reads, losses, saved = [], [], False
    for epoch in range(s.epoch, epochs):
        for x, y, ids in s.shard(data, batch_size=8):
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            before = s.steps
            s.step(opt, samples=len(x), loss=loss)
            opt.zero_grad()
            reads.append((before + 1, epoch, [int(i) for i in ids]))  # the loop step this batch belongs to
            losses.append(loss.item())
            if slow and rank == world - 1:
                time.sleep(slow)
            if save_at is not None and s.steps == save_at and s.steps != before and not saved:
                s.save(opt)
                saved = True
    report = s.close()
    return {"report": report, "reads": reads, "losses": losses, "steps": s.steps,
            "hash": state_hash(s.strategy.unwrap().state_dict())}


def _runs(rank, world, tmp):
    fixed = _auto_loop(rank, world, _settings(tmp, "fixed", micro_batches=6, speeds=[3, 2, 1]), save_at=9)
    resumed = _auto_loop(rank, world, _settings(tmp, "fixed", resume=True, micro_batches=6, speeds=[3, 2, 1]))
    balanced = _auto_loop(rank, world, _settings(tmp, "balanced", micro_batches=6, speeds=[1, 1, 1], balance=True,
                                                 rebalance_every=2), slow=0.08)
    return fixed, resumed, balanced


def _every_sample_once(runs, steps_before=6, ddp_step=24):
    """Each epoch's ids across ranks: no repeat, and the front of the epoch's order."""
    rep = runs[0]["report"]
    diloco_step = rep["micro_batches"] * 8
    per_epoch = {}
    for r in runs:
        for _, e, ids in r["reads"]:
            per_epoch.setdefault(e, []).extend(ids)
    first = steps_before * ddp_step
    want = {0: first + (N - first) // diloco_step * diloco_step, 1: N // diloco_step * diloco_step}
    for e, ids in per_epoch.items():
        assert len(ids) == len(set(ids)) == want[e], (e, len(ids), len(set(ids)), want[e])
        assert set(ids) == set(_order(N, e)[:want[e]])
    assert sorted(per_epoch) == [0, 1]


def test_auto_on_uneven_shares_switches_to_diloco_mid_epoch_and_reads_every_sample_once(tmp_path):
    from vpscluster.session.auto import WARMUP_STEPS, WINDOW_STEPS

    ranks = run_ranks(_runs, 3, tmp_path)
    fixed, resumed, balanced = ([r[i] for r in ranks] for i in range(3))

    # Fixed shares 3/2/1: ddp batches 12/8/4 for 6 steps, then diloco 3/2/1 micro-batches of 8,
    # rounds of H x 3 / 6 = 2 steps; 11 steps in epoch 0 (16 samples left out), 8 in epoch 1.
    rep = fixed[0]["report"]
    choice = rep["strategy_choice"]
    assert choice["at_step"] == WARMUP_STEPS + WINDOW_STEPS == 6 and "egress quota" in choice["reason"]
    assert choice["settings"]["name"] == rep["strategy"] == "diloco" and choice["settings"]["sync_every"] == 2
    assert choice["split"]["shares"] == rep["shares"] == [3, 2, 1] and rep["micro_batches"] == 6
    assert "uneven shares carried over: batches 3/2/1 of 6" in choice["reason"]
    assert rep["strategy_details"]["sync_every"] == 2 and rep["steps"] == 11 + 8
    assert [r["steps"] for r in fixed] == [19, 19, 19]
    for r, (ddp_batch, diloco_batches) in zip(fixed, ((12, 3), (8, 2), (4, 1))):
        sizes = {}
        for step, _, ids in r["reads"]:
            sizes.setdefault(step, []).append(len(ids))
        assert all(sizes[s] == [ddp_batch] for s in range(1, 7)) and all(sizes[s] == [8] * diloco_batches
                                                                      for s in range(7, 20))
    _every_sample_once(fixed)
    assert len({r["hash"] for r in fixed} | {p["model_sha256"] for p in rep["per_rank"]}) == 1
    assert sum(fixed[0]["losses"][-6:]) < sum(fixed[0]["losses"][:6])

    # Resumed from the checkpoint of step 9 (after the switch, mid-round): the choice and the
    # shares replayed, the same samples read from step 10 on, and the straight run's weights.
    rep = resumed[0]["report"]
    assert rep["resumed_from_step"] == 9 and rep["strategy_choice"] == fixed[0]["report"]["strategy_choice"]
    for straight, again in zip(fixed, resumed):
        assert again["reads"] == [x for x in straight["reads"] if x[0] > 9]
        assert again["hash"] == straight["hash"]
    assert len({r["hash"] for r in resumed}) == 1

    # Balanced from an even start, rank 2 slowed: the shares move under ddp, and diloco's split
    # is re-chosen from those speeds (H kept: 6 micro-batches a step, rounds of 2), the slow rank
    # with the fewest; every sample once; equal weights.
    rep = balanced[0]["report"]
    split = rep["strategy_choice"]["split"]
    assert rep["strategy"] == "diloco" and rep["strategy_choice"]["settings"]["micro_batches"] == 6
    # (The two fast ranks' steps take about a millisecond, so their measured speeds may differ by 2x
    # and their shares with them; what is fixed is that rank 2 is measured slowest and gets the
    # fewest micro-batches, fewer than the fastest rank's.)
    shares, speeds = split["shares"], split["speeds"]
    assert speeds[2] < min(speeds[:2]) and shares[2] == min(shares) < max(shares[:2]), split
    assert split["inner_steps"] == H, split
    _every_sample_once(balanced)
    assert len({r["hash"] for r in balanced} | {p["model_sha256"] for p in rep["per_rank"]}) == 1


def test_auto_takes_uneven_shares():
    from vpscluster.config import build
    from vpscluster.session.config import SessionConfig

    cfg = build(SessionConfig, {"strategy": {"name": "auto", "micro_batches": 4, "speeds": [3, 1]}}, "test")
    assert cfg.strategy.micro_batches == 4
