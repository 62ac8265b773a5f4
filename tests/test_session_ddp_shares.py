"""Uneven shares for a ddp session (issue #33): rank i reads batches of b_i samples (b_i follows
its share, sum b_i = world x batch_size) and its gradient is weighted by b_i in DDP's average
(`DDPStrategy.weigh_batch`), so a step equals one process's step on the union of the batches.

- 2 gloo ranks, shares 3/1: after one SGD step every rank holds the weights one process gets
  from the mean loss over both batches (allclose, fp32), for compress none and bf16; the plain
  average of the two batches' gradients is measurably elsewhere; the hashes agree.
- The loader: every rank makes the same number of steps per epoch (the even split's), the
  batches are disjoint and cover the epoch's steps; the weights sum to the world size.
- 3 gloo ranks through the README's loop: equal steps, equal hashes, the loss falls, the
  report and metrics carry the shares and batch sizes; with `balance` on, a slow rank's share
  shrinks from the measured step times, and a resume from its checkpoint keeps the moved shares.
"""

from __future__ import annotations

import json

import pytest

from test_session import make_data, run_ranks, user_loop


def _model(seed):
    import torch
    from torch import nn

    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 3))  # no dropout: one step is exact


def _one_step(rank, world, compress):
    import torch
    from torch.nn import functional as F

    from vpscluster import session
    from vpscluster.train.checkpoint import state_hash

    s = session.start(strategy={"name": "ddp", "micro_batches": 4, "speeds": [3, 1], "compress": compress})
    model = s.setup(_model(seed=rank))
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    x, y = next(iter(s.shard(make_data(), batch_size=8)))
    F.cross_entropy(model(x), y).backward()
    s.step(opt, samples=len(x), loss=None)
    weights = {k: v.tolist() for k, v in s.unwrap().state_dict().items()}  # plain values through the queue
    digest = state_hash(s.unwrap().state_dict())
    s.close()
    return {"x": x.tolist(), "y": y.tolist(), "weights": weights, "hash": digest}


def _step_on(batches, weights):
    """One process's SGD step from rank 0's start on these batches, their losses weighted."""
    import torch
    from torch.nn import functional as F

    model = _model(seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    loss = sum(w * F.cross_entropy(model(x), y) for (x, y), w in zip(batches, weights))
    loss.backward()
    opt.step()
    return model.state_dict()


def _close(a, b, **tol):
    import torch

    return all(torch.allclose(torch.tensor(a[k]), b[k], **tol) for k in a)


def _two_compressions(rank, world):
    return [_one_step(rank, world, c) for c in ("none", "bf16")]


def test_a_weighted_step_equals_one_process_on_the_union_of_the_batches():
    import torch

    ranks = run_ranks(_two_compressions, 2)
    for c, tol in ((0, {"rtol": 1e-5, "atol": 1e-6}), (1, {"rtol": 2e-2, "atol": 2e-3})):  # fp32, then bf16 wire
        r0, r1 = ({**r, "x": torch.tensor(r["x"]), "y": torch.tensor(r["y"])} for r in (ranks[0][c], ranks[1][c]))
        assert (len(r0["x"]), len(r1["x"])) == (12, 4)  # 2 x 8 samples, shares 3/1
        assert r0["hash"] == r1["hash"]
        union = _step_on([(torch.cat([r0["x"], r1["x"]]), torch.cat([r0["y"], r1["y"]]))], [1.0])
        assert _close(r0["weights"], union, **tol)
        plain = _step_on([(r0["x"], r0["y"]), (r1["x"], r1["y"])], [0.5, 0.5])  # DDP's average of the two means
        assert not _close(r0["weights"], plain, **tol)


def test_every_rank_makes_the_even_splits_steps_and_the_batches_cover_the_epoch():
    from vpscluster.session.config import SessionConfig
    from vpscluster.session.shard import ShardLoader
    from vpscluster.train.shares import batch_sizes

    class Fake:  # three ranks' views of one weighted session, without processes
        weighted = True

        def __init__(self, rank, shares):
            self.rank, self.cfg, self._data, self._micro = rank, SessionConfig(), {"epoch": 0, "index": 0}, (0, 1)
            self.shares, self.weights = shares, []

        def _shares(self):
            return self.shares

        def _shard_index(self):
            return self.rank

        def _batch_sizes(self, samples):
            return batch_sizes(self.shares, samples)

        def _weigh(self, sizes):
            self.weights.append(len(sizes) * sizes[self.rank] / sum(sizes))

    data = list(range(100))
    views = [Fake(r, [3, 2, 1]) for r in range(3)]
    loaders = [ShardLoader(f, data, 5, None) for f in views]
    seen = [[[int(v) for v in b] for b in loader] for loader in loaders]
    assert [len(s) for s in seen] == [len(loader) for loader in loaders] == [6, 6, 6]  # 100 // 15, as even
    assert [len(s[0]) for s in seen] == [8, 5, 2]  # 15 samples a step, 3:2:1 (rounded, at least 1)
    flat = [v for s in seen for b in s for v in b]
    assert len(flat) == len(set(flat)) == 90  # disjoint; the last 10 left out, as the even shard does
    assert all(abs(sum(w) - 3.0) < 1e-9 for w in zip(*(f.weights for f in views)))
    even = [len(list(ShardLoader(Fake(r, [1, 1, 1]), data, 5, None))) for r in range(3)]
    assert even == [6, 6, 6]
    assert batch_sizes([19, 1], 2) == [1, 1] and batch_sizes([6, 6, 6, 2], 128) == [39, 38, 38, 13]


def _loop(rank, world, tmp, balance, resume=False):
    settings = {"strategy": {"name": "ddp", "micro_batches": 12 if balance or resume else 6,
                             "speeds": [1, 1, 1] if balance or resume else [3, 2, 1], "balance": balance,
                             "rebalance_every": 4}, "run_dir": str(tmp / f"r{int(balance or resume)}"), "resume": resume}
    return user_loop(rank, world, settings, epochs=1, step_sleep=0.1 if balance else 0.0,
                     save_at=16 if balance else None)


def _all(rank, world, tmp):
    return [_loop(rank, world, tmp, False), _loop(rank, world, tmp, True), _loop(rank, world, tmp, False, resume=True)]


def test_three_ranks_share_3_2_1_and_rebalance_from_measured_times(tmp_path):
    ranks = run_ranks(_all, 3, tmp_path)
    fixed = [r[0] for r in ranks]
    # 384 samples, 3 x 8 a step: 16 steps on every rank, batches 12/8/4
    assert [r["steps"] for r in fixed] == [r["batches"] for r in fixed] == [16, 16, 16]
    assert len({r["hash"] for r in fixed} | {r["report"]["model_sha256"] for r in fixed}) == 1
    rep = fixed[0]["report"]
    assert (rep["shares"], rep["batch_sizes"], rep["samples"]) == ([3, 2, 1], [12, 8, 4], 16 * 24)
    assert fixed[0]["losses"][-1] < fixed[0]["losses"][0]
    lines = [json.loads(line) for line in (tmp_path / "r0" / "metrics.jsonl").read_text().splitlines()]
    assert lines[-1]["shares"] == [3, 2, 1] and lines[-1]["batch_sizes"] == [12, 8, 4]
    assert lines[-1]["samples"] == 12  # rank 0's own

    moved = [r[1] for r in ranks]  # even start, rank 2 sleeps 100 ms a step (far above a loaded machine's noise): its share shrinks
    rep = moved[0]["report"]
    assert rep["rebalances"] >= 1 and rep["shares"][2] < 4 and rep["batch_sizes"][2] < 8, rep
    assert len({r["hash"] for r in moved}) == 1 and [r["steps"] for r in moved] == [16, 16, 16]

    resumed = [r[2] for r in ranks]  # its checkpoint of step 16, resumed with no rebalancing: the moved shares
    rep = resumed[0]["report"]
    assert rep["resumed_from_step"] == 16 and [r["steps"] for r in resumed] == [32, 32, 32]
    assert (rep["shares"], rep["batch_sizes"]) == (moved[0]["report"]["shares"], moved[0]["report"]["batch_sizes"])
    assert len({r["hash"] for r in resumed}) == 1


@pytest.mark.parametrize("bad", [{"name": "hierarchical", "micro_batches": 4, "regions": ["a", "b"]}])
def test_strategies_without_shares_still_refuse_them(bad):
    from vpscluster.errors import UserError
    from vpscluster.session.config import SessionConfig
    from vpscluster.config import build

    with pytest.raises(UserError, match="not supported by --strategy hierarchical"):
        build(SessionConfig, {"strategy": bad}, "test")
