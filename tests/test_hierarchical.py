"""`hierarchical` on real gloo ranks (loopback): 4 ranks as 2 regions x 2, and 2 ranks as the
degenerate layouts (one region: ddp; one rank per region: diloco).

Each scenario drives the strategy as the training loop does (tokens_processed, step, finalize)
on a small MLP with different data per rank, and compares weight hashes across ranks, against a
straight run, and against ddp/diloco. All scenarios of a world size run in one spawn (module
fixtures), so the file stays well under 30 s.
"""

from __future__ import annotations

import pytest

from test_diloco_strategy import batch, digest, flat, run_ranks

from vpscluster.errors import UserError
from vpscluster.train.config import LauncherChoices, StrategyConfig
from vpscluster.train.strategies.hierarchical import RegionLayout, rank_regions

H = 4
STEPS = 10  # two outer syncs (4, 8), then a finalize mid-round
REGIONS = ["fra", "fra", "lax", "lax"]


def make_model():
    import torch
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 128), nn.Tanh(), nn.Linear(128, 16))


def make(rank, world, name="hierarchical", **overrides):
    import torch

    from vpscluster.train.strategies import get_strategy_class
    from vpscluster.train.strategies.base import DistContext

    overrides.setdefault("overlap_steps", 0)
    cfg = StrategyConfig(name=name, **overrides)
    strategy = get_strategy_class(name)(cfg, DistContext(rank=rank, world_size=world))
    model = make_model()
    module = strategy.setup(model)
    optimizer = torch.optim.AdamW(strategy.unwrap().parameters(), lr=1e-2)
    return strategy, module, optimizer


def train(strategy, module, optimizer, rank, steps, record=None):
    import torch.nn.functional as F

    for step in steps:
        x, y = batch(rank, step)
        x = x.repeat(1, 2)  # 32 features
        y = y.repeat(1, 4)  # 16 targets
        optimizer.zero_grad()
        F.mse_loss(module(x), y).backward()
        strategy.tokens_processed(8)
        strategy.step(optimizer, step)
        if record is not None:
            record.append((step, digest(flat(strategy.unwrap())), strategy.replica_sha256()))


def _four(rank, world):
    import copy

    out = {}
    # Replicas: local weights per step, θ_global (replica hash) per step; int8 on the wire.
    s, m, o = make(rank, world, regions=REGIONS, sync_every=H, wire_dtype="int8")
    steps: list = []
    train(s, m, o, rank, range(1, STEPS + 1), steps)
    s.finalize(STEPS)
    out["steps"] = steps
    out["final"] = digest(flat(s.unwrap()))
    out["describe"] = s.describe()
    straight = out["final"]
    s.close()

    # Resume mid-round (step 6 of a round of 4): finalize, save as the trainer does, rebuild, go on.
    s, m, o = make(rank, world, regions=REGIONS, sync_every=H, wire_dtype="int8")
    train(s, m, o, rank, range(1, 7))
    s.finalize(6)
    saved = (copy.deepcopy(s.unwrap().state_dict()), copy.deepcopy(o.state_dict()), copy.deepcopy(s.state_dict()))
    s.close()
    s, m, o = make(rank, world, regions=REGIONS, sync_every=H, wire_dtype="int8")
    s.unwrap().load_state_dict(saved[0])
    o.load_state_dict(saved[1])
    s.load_state_dict(saved[2])
    train(s, m, o, rank, range(7, STEPS + 1))
    s.finalize(STEPS)
    out["resumed"] = digest(flat(s.unwrap()))
    out["straight"] = straight
    s.close()

    # Bytes: hierarchical (fp32) against flat ddp over the same steps.
    s, m, o = make(rank, world, regions=REGIONS, sync_every=H, wire_dtype="fp32")
    train(s, m, o, rank, range(1, 2 * H + 1))
    out["hier_bytes"] = s.describe()
    s.close()
    s, m, o = make(rank, world, name="ddp")
    train(s, m, o, rank, range(1, 2 * H + 1))
    out["ddp_bytes"] = s.comm.total_bytes_sent
    s.close()
    return out


@pytest.fixture(scope="module")
def four():
    return run_ranks(_four, 4)


def test_ranks_of_a_region_are_identical_every_step_and_all_replicas_after_each_outer_sync(four):
    by_step = [dict() for _ in range(STEPS)]
    for rank, out in enumerate(four):
        for step, local, replica in out["steps"]:
            by_step[step - 1][rank] = (local, replica)
    for step, ranks in enumerate(by_step, start=1):
        assert ranks[0][0] == ranks[1][0] and ranks[2][0] == ranks[3][0], f"a region's ranks differ at step {step}"
        assert len({r[1] for r in ranks.values()}) == 1, f"θ_global differs across ranks at step {step}"
        if step % H == 0:  # the outer sync wrote θ_global into every replica
            assert len({r[0] for r in ranks.values()}) == 1, f"replicas differ after the outer sync at step {step}"
        else:  # between syncs the regions train apart (so the checks above can fail)
            assert ranks[0][0] != ranks[2][0]
    assert len({out["final"] for out in four}) == 1  # finalize: one model everywhere
    d = four[0]["describe"]
    assert d["outer_syncs"] == 3 and d["wire_dtype"] == "int8"  # steps 4, 8 and the finalize
    assert [r["ranks"] for r in d["regions"]] == [[0, 1], [2, 3]]
    assert [out["describe"]["leader"] for out in four] == [True, False, True, False]


def test_resume_mid_round_equals_a_straight_run(four):
    assert all(out["resumed"] == out["straight"] for out in four)


def test_inter_region_bytes_are_about_h_times_fewer_than_flat_ddp(four):
    hier = [out["hier_bytes"] for out in four]
    # Flat ddp's ring over ranks 0-1-2-3-0 crosses the regions on 2 of its 4 hops.
    ddp_inter = sum(out["ddp_bytes"] for out in four) * 2 / 4
    inter = sum(d["bytes_inter_region"] for d in hier)
    assert inter > 0 and all(d["bytes_intra_region"] > 0 for d in hier)
    # Non-leaders send only agreement flags and the start-up hash across regions.
    assert hier[1]["bytes_inter_region"] < hier[0]["bytes_inter_region"] / 20
    ratio = ddp_inter / inter
    # Per round: ddp sends H all-reduces over 4 ranks, the leaders one 2-rank all-reduce (1.5 H).
    assert H <= ratio <= 2 * H, ratio
    # Inside a region every step still all-reduces (a 2-rank ring: 1 x the gradient per rank).
    assert hier[0]["bytes_intra_region"] >= 2 * H * 4 * sum(p.numel() for p in make_model().parameters())


def _two(rank, world):
    out = {}
    for name, kw in (("ddp", {}), ("hierarchical", {"regions": ["one", "one"]}),
                     ("diloco", {}), ("hierarchical", {"regions": ["fra", "lax"]})):
        s, m, o = make(rank, world, name=name, sync_every=3, wire_dtype="int8", **kw)
        train(s, m, o, rank, range(1, 8))
        s.finalize(7)
        out[f"{name}-{len(set(kw.get('regions', [1, 2])))}"] = (digest(flat(s.unwrap())), s.lr_scale())
        s.close()
    return out


@pytest.fixture(scope="module")
def two():
    return run_ranks(_two, 2)


def test_one_region_is_ddp_and_one_rank_per_region_is_diloco(two):
    for out in two:
        assert out["hierarchical-1"] == out["ddp-2"]  # the same weights, bit for bit, and lr 1
        assert out["hierarchical-2"] == out["diloco-2"]  # the same outer steps and inner lr scale
        assert out["hierarchical-1"][0] != out["hierarchical-2"][0]


def test_regions_come_from_ranks_or_nodes_and_a_missing_one_is_refused():
    cfg = StrategyConfig(name="hierarchical", launcher=LauncherChoices(node_regions={"a": "fra", "b": "fra", "c": "lax"}))
    assert rank_regions(cfg, 4, lambda: ["a", "b", "c", "c"]) == ["fra", "fra", "lax", "lax"]
    layout = RegionLayout.of(["lax", "fra", "lax", "fra"])
    assert layout.members == ((0, 2), (1, 3)) and layout.leaders == [0, 1]
    with pytest.raises(UserError, match="no region for node"):
        rank_regions(cfg, 2, lambda: ["a", "x"])
    with pytest.raises(UserError, match="one per rank"):
        rank_regions(StrategyConfig(name="hierarchical", regions=["fra"]), 2, list)
    with pytest.raises(UserError, match="labels.region"):
        rank_regions(StrategyConfig(name="hierarchical"), 2, list)
    with pytest.raises(UserError, match="micro-batches"):
        StrategyConfig(name="hierarchical", micro_batches=4)
