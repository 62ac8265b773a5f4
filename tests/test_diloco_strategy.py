"""DiLoCo on 2 real gloo ranks (loopback): the outer step's arithmetic, agreement, weighting, resume.

Each test spawns the ranks, runs a small MLP through the strategy exactly as the training loop
does (tokens_processed, step, finalize), and compares weights across ranks and against the
arithmetic written out by hand.
"""

from __future__ import annotations

import copy
import hashlib
import multiprocessing as mp
import traceback
from datetime import timedelta

import pytest

from conftest import free_port

from vpscluster.train.strategies.diloco import inner_lr_scale, outer_settings, split_fragments, sync_offset

TIMEOUT_S = 60


def _entry(fn, rank, world, port, args, queue):
    import torch.distributed as dist

    try:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
            timeout=timedelta(seconds=TIMEOUT_S),
        )
        queue.put((rank, "ok", _portable(fn(rank, world, *args))))
    except BaseException:  # the parent reports it with the rank
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _portable(value):
    """Tensors as numpy arrays: a torch tensor in a Queue is shared memory that dies with the rank."""
    import torch

    if isinstance(value, torch.Tensor):
        return value.detach().numpy().copy()
    if isinstance(value, (list, tuple)):
        return type(value)(_portable(v) for v in value)
    if isinstance(value, dict):
        return {k: _portable(v) for k, v in value.items()}
    return value


def run_ranks(fn, world: int = 2, *args):
    """Run fn(rank, world, *args) in `world` gloo processes; return the results in rank order."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(fn, r, world, port, args, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results = {}
    try:
        for _ in range(world):
            rank, status, value = queue.get(timeout=TIMEOUT_S * 2)
            if status != "ok":
                pytest.fail(f"rank {rank} failed:\n{value}")
            results[rank] = value
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return [results[r] for r in range(world)]


# -- helpers that run inside the ranks ---------------------------------------------------------


def make_model():
    import torch
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))


def make_strategy(rank, world, **overrides):
    from vpscluster.train.config import StrategyConfig
    from vpscluster.train.strategies.base import DistContext
    from vpscluster.train.strategies.diloco import DiLoCoStrategy

    overrides.setdefault("overlap_steps", 0)  # these tests check the blocking sync (overlap: test_diloco_overlap.py)
    cfg = StrategyConfig(name="diloco", **overrides)
    cfg.validate()
    return DiLoCoStrategy(cfg, DistContext(rank=rank, world_size=world))


def batch(rank, step):
    """Different, deterministic data per rank and step."""
    import torch

    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)


def train_step(model, optimizer, strategy, rank, step, tokens=8):
    import torch.nn.functional as F

    x, y = batch(rank, step)
    optimizer.zero_grad()
    F.mse_loss(model(x), y).backward()
    strategy.tokens_processed(tokens)
    strategy.step(optimizer, step)


def flat(model):
    import torch

    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def digest(t):
    return hashlib.sha256(t.detach().contiguous().numpy().tobytes()).hexdigest()


# -- pure arithmetic ---------------------------------------------------------------------------


def test_fragments_are_contiguous_balanced_and_nonempty():
    groups = split_fragments([100, 10, 100, 10, 100, 10], 3)
    assert groups == [[0, 1], [2, 3], [4, 5]]
    assert split_fragments([5, 1, 1], 3) == [[0], [1], [2]]
    assert [i for g in split_fragments([7] * 10, 4) for i in g] == list(range(10))
    with pytest.raises(Exception, match="fragments"):
        split_fragments([1, 2], 3)


def test_streaming_offsets_spread_over_the_round():
    assert [sync_offset(f, 4, 8) for f in range(4)] == [2, 4, 6, 0]
    assert [sync_offset(f, 1, 5) for f in range(1)] == [0]


# -- identical start -----------------------------------------------------------------------------


def _start(rank, world):
    import torch

    out = []
    for seed_of_rank in (lambda r: 0, lambda r: r):  # same seeds, then different ones
        torch.manual_seed(seed_of_rank(rank))
        from torch import nn

        model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
        strategy = make_strategy(rank, world, sync_every=2)
        strategy.setup(model)
        out.append((digest(flat(model)), digest(torch.cat(strategy.global_flat)), strategy.comm.take()[1]))
    return out


def test_setup_gives_every_rank_rank0s_weights_and_sends_them_only_when_needed(scenarios):
    (same0, diff0), (same1, diff1) = scenarios["start"]
    assert same0[0] == same1[0] == same0[1] and diff0[0] == diff1[0] == diff0[1]
    assert same0[0] == diff0[0]  # rank 0's seed-0 weights everywhere
    assert same0[2] < 1000  # only a digest went out
    assert diff0[2] - same0[2] == 4 * (16 * 32 + 32 + 32 * 4 + 4)  # rank 0 also broadcast the weights
    assert diff1[2] < 1000


# -- H = 1, outer lr 1, no momentum: the outer step is plain averaging --------------------------


def _h1_average(rank, world):
    import torch
    import torch.distributed as dist

    model = make_model()
    strategy = make_strategy(rank, world, sync_every=1, outer_lr=1.0, outer_momentum=0.0)
    model = strategy.setup(model)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    # A twin that takes the same inner steps without any sync: its weights after each step are
    # what this rank contributes; the strategy must end on the mean of the twins.
    errors = []
    for step in range(1, 4):
        twin = copy.deepcopy(model)
        twin_opt = torch.optim.AdamW(twin.parameters(), lr=0.05)
        twin_opt.load_state_dict(copy.deepcopy(opt.state_dict()))  # load_state_dict shares tensors
        x, y = batch(rank, step)
        twin_opt.zero_grad()
        torch.nn.functional.mse_loss(twin(x), y).backward()
        twin_opt.step()
        train_step(model, opt, strategy, rank, step)
        local = flat(twin)
        gathered = [torch.empty_like(local) for _ in range(world)]
        dist.all_gather(gathered, local)
        expected = torch.stack(gathered).mean(0)
        errors.append(float((flat(model) - expected).abs().max()))
        assert not torch.equal(gathered[0], gathered[1])  # the ranks really trained differently
    return errors, digest(flat(model))


def test_h1_lr1_no_momentum_equals_weight_average(scenarios):
    results = scenarios["h1"]
    for errors, _ in results:
        assert max(errors) < 1e-6, errors
    assert results[0][1] == results[1][1]


# -- agreement after every outer step, for every wire dtype and streaming -----------------------


def _agreement(rank, world, wire_dtype, fragments):
    import torch

    model = make_model()
    H = 4
    strategy = make_strategy(rank, world, sync_every=H, wire_dtype=wire_dtype, fragments=fragments)
    model = strategy.setup(model)
    opt = torch.optim.AdamW(model.parameters(), lr=0.02)
    log = []  # (step, synced fragment indices, per-fragment digests of model and global copy)
    for step in range(1, 3 * H + 1):
        train_step(model, opt, strategy, rank, step)
        synced = [f for f in range(fragments) if step % H == sync_offset(f, fragments, H)]
        local = [digest(torch.cat([p.detach().reshape(-1) for p in ps])) for ps in strategy.fragment_params]
        log.append((step, synced, local, [digest(g) for g in strategy.global_flat]))
    comm_seconds, comm_bytes = strategy.comm.take()
    return log, strategy.outer_steps, comm_bytes


AGREEMENT_CASES = [("fp32", 1), ("int8", 1), ("bf16", 2), ("int8", 3)]


def _sync_hashes(rank, world):
    """`sync_hashes`: the lines each rank logs, and the digests of its global copies meanwhile."""
    import contextlib
    import io

    import torch

    from vpscluster.train.strategies.diloco import parse_sync_hash

    model = make_model()
    H, fragments = 4, 2
    strategy = make_strategy(rank, world, sync_every=H, fragments=fragments, sync_hashes=True)
    model = strategy.setup(model)
    opt = torch.optim.AdamW(model.parameters(), lr=0.02)
    out, expected = io.StringIO(), []
    with contextlib.redirect_stdout(out):
        for step in range(1, 2 * H + 1):
            train_step(model, opt, strategy, rank, step)
            for f in range(fragments):
                if step % H == sync_offset(f, fragments, H):
                    expected.append((f, step, digest(strategy.global_flat[f])))
    return [parse_sync_hash(line) for line in out.getvalue().splitlines()], expected


def test_sync_hashes_name_each_outer_update_and_agree_across_ranks(scenarios):
    (lines0, expected0), (lines1, expected1) = scenarios["hashes"]
    assert None not in lines0 and len(lines0) == 4  # 2 fragments, 2 rounds
    assert [(l["fragment"], l["step"], l["sha256"]) for l in lines0] == expected0
    assert [l["outer_step"] for l in lines0] == [1, 1, 2, 2] and {l["world_size"] for l in lines0} == {2}
    assert lines0 == lines1 and expected0 == expected1
    assert len({l["sha256"] for l in lines0}) == 4


def _agreement_cases(rank, world):
    return [_agreement(rank, world, *case) for case in AGREEMENT_CASES]


@pytest.mark.parametrize("wire_dtype,fragments", AGREEMENT_CASES)
def test_all_ranks_hold_identical_weights_after_every_outer_step(scenarios, wire_dtype, fragments):
    rank0, rank1 = scenarios["agreement"]
    (log0, outer0, bytes0), (log1, outer1, bytes1) = dict(zip(AGREEMENT_CASES, zip(rank0, rank1)))[(wire_dtype, fragments)]
    assert outer0 == outer1 == 3 * fragments
    assert bytes0 > 0 and bytes1 > 0
    diverged = 0
    for (step, synced, local0, global0), (_, _, local1, global1) in zip(log0, log1):
        assert global0 == global1, f"global copies differ at step {step}"
        for f in range(fragments):
            if f in synced:
                assert local0[f] == local1[f] == global0[f], f"fragment {f} differs after its sync at step {step}"
            else:
                diverged += local0[f] != local1[f]
    assert diverged > 0  # between syncs the ranks train apart, so the check above can fail


# -- token weighting ---------------------------------------------------------------------------


class SetWeights:
    """An 'optimizer' whose step sets the model to given weights (known local results)."""

    def __init__(self, model, target):
        self.model, self.target = model, target

    def step(self):
        import torch

        with torch.no_grad():
            offset = 0
            for p in self.model.parameters():
                p.copy_(self.target[offset : offset + p.numel()].view_as(p))
                offset += p.numel()


def _weighted(rank, world, tokens_per_step):
    import torch

    model = make_model()
    strategy = make_strategy(rank, world, sync_every=2, outer_lr=1.0, outer_momentum=0.0)
    model = strategy.setup(model)
    start = flat(model).clone()
    target = start + (rank + 1) * 0.5 + torch.linspace(-1, 1, start.numel()) * rank
    opt = SetWeights(model, target)
    for step in (1, 2):
        strategy.tokens_processed(tokens_per_step[rank])
        strategy.step(opt, step)
    return start, target, flat(model).clone()


def test_pseudo_gradients_are_weighted_by_tokens(scenarios):
    import torch

    (start, t0, out0), (_, t1, out1) = (map(torch.from_numpy, r) for r in scenarios["weighted"])

    expected = 0.75 * t0 + 0.25 * t1  # 300 and 100 tokens: weights 3/4 and 1/4, not 1/2
    torch.testing.assert_close(out0, expected, rtol=0, atol=1e-6)
    assert torch.equal(out0, out1)
    assert (out0 - (t0 + t1) / 2).abs().max() > 0.1


# -- the outer warm-up: plain averaging first, then Nesterov with a growing momentum -------------


def test_outer_warmup_goes_from_plain_averaging_to_the_outer_optimizer():
    assert outer_settings(0.7, 0.9, 0, 0) == (0.7, 0.9)  # no warm-up: DiLoCo's step from the first sync
    assert outer_settings(0.7, 0.9, 3, 0) == (1.0, 0.0)  # the first sync: the (token-weighted) average
    lr, mu = outer_settings(0.7, 0.9, 3, 1)
    assert lr == pytest.approx(0.9) and mu == pytest.approx(0.3)
    assert outer_settings(0.7, 0.9, 3, 3) == outer_settings(0.7, 0.9, 3, 30) == (0.7, 0.9)
    # The gain on a fresh pseudo-gradient, lr·(1 + μ), rises smoothly from 1 (the average) to 1.33.
    gains = [lr * (1 + mu) for lr, mu in (outer_settings(0.7, 0.9, 5, k) for k in range(7))]
    assert gains[0] == 1.0 and gains == sorted(gains) and gains[-1] == pytest.approx(0.7 * 1.9)


def test_inner_lr_is_scaled_by_one_over_sqrt_of_the_replicas_share_of_the_global_batch():
    from vpscluster.errors import UserError
    from vpscluster.train.config import StrategyConfig
    from vpscluster.train.strategies.base import DistContext
    from vpscluster.train.strategies.ddp import DDPStrategy
    from vpscluster.train.strategies.diloco import DiLoCoStrategy

    # M micro-batches per global step (one per rank by default): a replica steps on 1/M of it.
    assert [inner_lr_scale(0.0, m) for m in (0, 1, 4, 16)] == [1.0, 1.0, 0.5, 0.25]
    assert inner_lr_scale(0.8, 4) == inner_lr_scale(0.8, 1) == 0.8  # set: used as is
    four = DistContext(world_size=4)
    strategy = DiLoCoStrategy(StrategyConfig(name="diloco"), four)
    assert strategy.lr_scale() == 0.5 and strategy.describe()["inner_lr_scale"] == 0.5
    shares = DiLoCoStrategy(StrategyConfig(name="diloco", micro_batches=16), four)  # --micro-batches 16
    assert shares.lr_scale() == 0.25
    assert DiLoCoStrategy(StrategyConfig(name="diloco", inner_lr_scale=1.0), four).lr_scale() == 1.0
    assert DDPStrategy(StrategyConfig(name="ddp"), four).lr_scale() == 1.0  # ddp steps on the global batch
    with pytest.raises(UserError, match="inner_lr_scale"):
        StrategyConfig(name="diloco", inner_lr_scale=-0.5)


WARMUP = 3
ROUNDS = 5


def _warmup(rank, world):
    """H = 2 with known local results (SetWeights): every sync's global copy, on both ranks."""
    import torch

    model = make_model()
    strategy = make_strategy(rank, world, sync_every=2, outer_lr=0.7, outer_momentum=0.9, outer_warmup=WARMUP)
    model = strategy.setup(model)
    start = flat(model).clone()
    targets, globals_ = [], []
    for k in range(ROUNDS):
        # Round k's local result: a rank- and round-dependent move away from the last global copy.
        g = torch.Generator().manual_seed(100 * rank + k)
        target = torch.cat(strategy.global_flat) + torch.randn(start.numel(), generator=g) * (2.0 if k == 0 else 0.3)
        opt = SetWeights(model, target)
        for step in (2 * k + 1, 2 * k + 2):
            strategy.tokens_processed(8)
            strategy.step(opt, step)
        targets.append(target)
        globals_.append(torch.cat(strategy.global_flat).clone())
    assert torch.equal(flat(model), globals_[-1])
    return start, targets, globals_, list(strategy.fragment_syncs), strategy.describe()["outer_warmup"]


def test_outer_warmup_is_the_same_arithmetic_on_every_rank(scenarios):
    import torch

    (start, t0, g0, syncs0, w0), (start1, t1, g1, syncs1, _) = scenarios["warmup"]
    start = torch.from_numpy(start)
    assert syncs0 == syncs1 == [ROUNDS] and w0 == WARMUP
    for a, b in zip(g0, g1):
        assert (a == b).all()  # bit-identical global copies on both ranks after every sync
    # The same steps written out by hand (equal tokens: Δ = mean of the ranks' pseudo-gradients).
    theta, m = start.clone(), torch.zeros_like(start)
    for k in range(ROUNDS):
        delta = ((theta - torch.from_numpy(t0[k])) + (theta - torch.from_numpy(t1[k]))) / 2
        lr, mu = outer_settings(0.7, 0.9, WARMUP, k)
        m = mu * m + delta
        theta = theta - lr * (delta + mu * m)
        torch.testing.assert_close(torch.from_numpy(g0[k]), theta, rtol=0, atol=1e-5)
        if k == 0:  # the first sync is exactly the average of the ranks' models, no overshoot
            torch.testing.assert_close(theta, (torch.from_numpy(t0[0]) + torch.from_numpy(t1[0])) / 2, rtol=0, atol=1e-6)


# -- resume in the middle of a round ------------------------------------------------------------


def _run_with_resume(rank, world, stop_at, total, fragments, warmup=0):
    import torch

    H = 4

    def build():
        model = make_model()
        strategy = make_strategy(rank, world, sync_every=H, fragments=fragments, wire_dtype="int8",
                                 outer_warmup=warmup)
        model = strategy.setup(model)
        return model, strategy, torch.optim.AdamW(model.parameters(), lr=0.02)

    model, strategy, opt = build()
    for step in range(1, stop_at + 1):
        train_step(model, opt, strategy, rank, step)
    synced_at_stop = None
    if stop_at < total:
        strategy.finalize(stop_at)  # the run "ends" mid-round, then a checkpoint is written
        ckpt = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict(), "strategy": strategy.state_dict()})
        synced_at_stop = digest(flat(model))
        model, strategy, opt = build()  # a new process, in effect
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        strategy.load_state_dict(ckpt["strategy"])
        for step in range(stop_at + 1, total + 1):
            train_step(model, opt, strategy, rank, step)
    strategy.finalize(total)
    return digest(flat(model)), [digest(g) for g in strategy.global_flat], synced_at_stop


def _straight_and_resumed(rank, world, fragments, warmup=0):
    return (_run_with_resume(rank, world, 12, 12, fragments, warmup),
            _run_with_resume(rank, world, 6, 12, fragments, warmup))


@pytest.mark.parametrize("case", ["resume1", "resume2-warmup"])
def test_resume_mid_round_equals_uninterrupted_run(scenarios, case):
    (straight0, resumed0), (straight1, resumed1) = scenarios[case]
    assert straight0[:2] == straight1[:2]  # ranks agree
    assert resumed0[:2] == straight0[:2]  # and stopping at step 6 and resuming changed nothing
    assert resumed0[2] == resumed1[2]  # finalize at step 6 left identical weights everywhere
    assert resumed0[2] != straight0[0]


# -- every scenario above in one pair of processes (a spawn costs seconds of imports) -------------


def _all_scenarios(rank, world):
    return {
        "start": _start(rank, world),
        "h1": _h1_average(rank, world),
        "agreement": _agreement_cases(rank, world),
        "weighted": _weighted(rank, world, [300, 100]),
        "resume1": _straight_and_resumed(rank, world, 1),
        "resume2-warmup": _straight_and_resumed(rank, world, 2, warmup=3),  # stops inside the outer warm-up
        "warmup": _warmup(rank, world),
        "hashes": _sync_hashes(rank, world),
    }


@pytest.fixture(scope="module")
def scenarios():
    """{scenario: [rank 0's result, rank 1's result]} from one run of 2 gloo ranks."""
    rank0, rank1 = run_ranks(_all_scenarios, 2)
    return {key: [rank0[key], rank1[key]] for key in rank0}


def test_reshard_state_counts_a_sync_in_flight_as_skipped():
    # A checkpoint of another world: its in-flight reduction cannot finish without the old
    # ranks, so its steps and tokens ride on the fragment's next sync; the rest is kept as is.
    import torch

    strategy = make_strategy(0, 1)
    g = [torch.ones(3), torch.zeros(2)]
    state = {"format": 1, "fragment_numels": [3, 2], "global": g, "momentum": [torch.zeros(3), torch.zeros(2)],
             "steps_since_sync": [1, 3], "tokens_since_sync": [10.0, 30.0], "outer_steps": 4,
             "fragment_syncs": [2, 2],
             "in_flight": [{"fragment": 0, "apply_at": 9, "at_send": torch.ones(3), "steps": 4, "tokens": 40.0,
                            "result": None, "sent": torch.ones(3)}]}
    out = strategy.reshard_state(state)
    assert out["in_flight"] == [] and out["steps_since_sync"] == [5, 3] and out["tokens_since_sync"] == [50.0, 30.0]
    assert out["global"] is g and out["outer_steps"] == 4 and out["fragment_syncs"] == [2, 2]
    assert len(state["in_flight"]) == 1 and state["steps_since_sync"] == [1, 3]  # the loaded shard is not changed


def test_time_step_with_sync_runs_the_step_once_and_applies_the_outer_update():
    import torch

    from vpscluster.train.model import build_model
    from vpscluster.train.presets import ModelShape
    from vpscluster.train.strategies.diloco import time_step_with_sync

    net = build_model(ModelShape(d_model=32, n_layer=1, n_head=2, seq_len=16, batch_size=2), seed=0)
    before = [p.detach().clone() for p in net.parameters()]
    calls = []

    def step():
        calls.append(1)
        with torch.no_grad():
            for p in net.parameters():
                p.add_(0.01)  # the inner step's progress, made while the sync is in flight

    seconds = time_step_with_sync(net, step, "int8", world_size=3)
    assert calls == [1] and seconds > 0
    after = list(net.parameters())
    # global (= the start) - lr * Nesterov(world x the zero delta) + the progress: the progress survives
    assert all(torch.allclose(a, b + 0.01, atol=1e-5) for a, b in zip(after, before))
