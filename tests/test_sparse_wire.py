"""The sparse DiLoCo wire (`train/strategies/sparse_wire.py`): chunked top-k in 2 or 4 bits with
packed indices, error feedback, and its all-gather exchange and DiLoCo use on 3 real gloo ranks
(bit-identical global weights after every sync; a resume mid-round equals a straight run)."""

from __future__ import annotations

import copy

import pytest
import torch

from test_diloco_strategy import digest, flat, make_model, make_strategy, run_ranks, train_step
from vpscluster.train.strategies.base import CommStats, ring_allreduce_bytes
from vpscluster.train.strategies.sparse_wire import (
    CHUNK, TOP_K, ErrorFeedback, SparseCodec, pack_bits, sparse_nbytes, unpack_bits, wire_codec,
)

WORLD = 3


def spread(numel: int, seed: int = 0) -> torch.Tensor:
    """Values whose magnitude varies by orders of magnitude from chunk to chunk."""
    g = torch.Generator().manual_seed(seed)
    scales = 10.0 ** torch.randint(-4, 3, (numel // 256 + 1,), generator=g).float()
    return torch.randn(numel, generator=g) * scales.repeat_interleave(256)[:numel]


# -- packing and the codec ------------------------------------------------------------------------


@pytest.mark.parametrize("bits", [1, 2, 4, 12])
def test_bit_packing_round_trips_in_the_fewest_bytes(bits):
    g = torch.Generator().manual_seed(bits)
    for count in (1, 7, 8, 1000):
        v = torch.randint(0, 2**bits, (count,), generator=g)
        data = pack_bits(v, bits)
        assert data.dtype == torch.uint8 and data.numel() == -(-count * bits // 8)
        assert torch.equal(unpack_bits(data, count, bits), v)


@pytest.mark.parametrize("bits,chunk,k", [(2, 256, 8), (4, 256, 8), (2, CHUNK, TOP_K), (4, CHUNK, TOP_K)])
def test_round_trip_keeps_the_top_k_of_each_chunk_within_half_a_step(bits, chunk, k):
    codec = SparseCodec(f"sparse{bits}", bits, chunk, k)
    n = 5 * chunk + chunk // 3  # a padded last chunk
    x = spread(n, seed=bits)
    x[chunk : 2 * chunk] = 0.0  # an all-zero chunk decodes to zeros (no 0/0)
    data = codec.encode(x, tokens=123.0)
    assert data.dtype == torch.uint8 and data.numel() == codec.encoded_nbytes(n) == sparse_nbytes(n, bits, chunk, k)
    y, tokens = codec.decode(data, n)
    assert tokens == 123.0 and y.shape == x.shape
    padded = torch.zeros(6 * chunk)
    padded[:n] = x
    for c, (xc, yc) in enumerate(zip(padded.split(chunk), torch.cat([y, torch.zeros(6 * chunk - n)]).split(chunk))):
        kept = set(xc.abs().topk(k).indices.tolist())
        if c == 1:
            assert torch.all(yc == 0)
            continue
        assert set(yc.nonzero().flatten().tolist()) == kept  # the indices, exactly
        idx = torch.tensor(sorted(kept))
        mags = xc[idx].abs()
        half_step = (mags.max() - mags.min()) / (2 * (2 ** (bits - 1) - 1))
        err = (yc[idx] - xc[idx]).abs()
        assert torch.all(err <= half_step * (1 + 1e-5) + 1e-30)
        assert torch.all(torch.sign(yc[idx]) == torch.sign(xc[idx]))
        assert torch.all(yc[idx].abs() >= mags.min() * (1 - 1e-6)) and torch.all(yc[idx].abs() <= mags.max() * (1 + 1e-6))


def test_sizes_follow_the_formula():
    # Per chunk of 4096: two fp32 scales, 64 indices of 12 bits, 64 values of 2 (4) bits; 8 bytes of tokens.
    assert sparse_nbytes(CHUNK, 2) == 8 + 8 + 64 * 12 // 8 + 64 * 2 // 8 == 128
    assert sparse_nbytes(10 * CHUNK, 4) == 8 + 10 * (8 + 96 + 32)
    assert sparse_nbytes(CHUNK + 1, 2) == 8 + 2 * 120  # a partial chunk costs a whole one
    int8 = wire_codec("int8").encoded_nbytes(1024 * CHUNK)
    assert int8 / sparse_nbytes(1024 * CHUNK, 2) > 34
    assert wire_codec("sparse4").name == "sparse4" and wire_codec("fp32").name == "fp32"


# -- error feedback -------------------------------------------------------------------------------


def test_error_feedback_keeps_exactly_what_was_not_sent():
    codec = SparseCodec("sparse2", 2, 256, 8)
    n = 3 * 256
    ef = ErrorFeedback([n, 10])
    total_in = torch.zeros(n, dtype=torch.float64)
    total_sent = torch.zeros(n, dtype=torch.float64)
    for r in range(6):
        delta = spread(n, seed=10 + r)
        before = ef.residual[0].clone()
        acc = ef.accumulate(0, delta, codec)
        assert torch.equal(acc, before + delta)
        if r == 3:  # a skipped sync: nothing sent, the residual stays (the next delta covers the round)
            ef.skipped(0)
            assert torch.equal(ef.residual[0], before) and not ef.pending
            continue
        sent = codec.decode(codec.encode(acc), n)[0]
        ef.landed(0)
        assert torch.equal(ef.residual[0], acc - sent)  # what was not sent plus the quantization error
        assert torch.count_nonzero(sent) == 3 * 8
        total_in += delta.double()
        total_sent += sent.double()
    # Nothing is lost: everything accumulated is either sent or still in the residual (fp32 rounding only).
    torch.testing.assert_close(total_sent + ef.residual[0].double(), total_in, rtol=1e-6, atol=1e-6 * total_in.abs().max().item())
    assert ef.residual[0].abs().max() > 0 and torch.all(ef.residual[1] == 0)
    copy_ = ErrorFeedback([n, 10])
    copy_.load_state_dict(copy.deepcopy(ef.state_dict()))
    assert torch.equal(copy_.residual[0], ef.residual[0])


# -- on real gloo ranks ---------------------------------------------------------------------------


def _exchange(rank, world):
    from vpscluster.train.strategies.sparse_wire import all_gather_sum

    codec = SparseCodec("sparse2", 2)
    n = 2 * CHUNK + 100
    comm = CommStats()
    acc = spread(n, seed=rank)
    out = all_gather_sum(acc, 8.0 * (rank + 1), codec, comm, world)
    seconds, nbytes = comm.take()
    return out, nbytes, codec.encode(acc, 8.0 * (rank + 1))


def _sparse_agreement(rank, world, wire, fragments, overlap):
    model = make_model()
    H = 4
    strategy = make_strategy(rank, world, sync_every=H, wire_dtype=wire, fragments=fragments, overlap_steps=overlap)
    model = strategy.setup(model)
    opt = torch.optim.AdamW(model.parameters(), lr=0.02)
    log = []
    for step in range(1, 3 * H + 1 + overlap):  # the last sync sent lands too
        train_step(model, opt, strategy, rank, step, tokens=8 * (rank + 1))
        log.append((step, [digest(g) for g in strategy.global_flat], strategy.outer_steps,
                    [digest(r) for r in strategy.ef.residual]))
    _, nbytes = strategy.comm.take()
    numels = [g.numel() for g in strategy.global_flat]
    return log, nbytes, numels, digest(flat(model))


def _resume(rank, world, stop_at, total, overlap, finalize_at_stop):
    H = 4

    def build():
        model = make_model()
        strategy = make_strategy(rank, world, sync_every=H, wire_dtype="sparse2", fragments=2, overlap_steps=overlap)
        model = strategy.setup(model)
        return model, strategy, torch.optim.AdamW(model.parameters(), lr=0.02)

    model, strategy, opt = build()
    for step in range(1, stop_at + 1):
        train_step(model, opt, strategy, rank, step)
    if stop_at < total:
        if finalize_at_stop:
            strategy.finalize(stop_at)  # the run ends mid-round; the checkpoint holds the state before it
        ckpt = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict(), "strategy": strategy.state_dict()})
        if not finalize_at_stop:
            strategy.close()  # a crash: the sync in flight is abandoned
        model, strategy, opt = build()
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        strategy.load_state_dict(ckpt["strategy"])
        for step in range(stop_at + 1, total + 1):
            train_step(model, opt, strategy, rank, step)
    strategy.finalize(total)
    return digest(flat(model)), [digest(g) for g in strategy.global_flat], [digest(r) for r in strategy.ef.residual]


RESUME_CASES = {"blocking": (6, 0, True), "overlap-in-flight": (8, 1, False)}  # stop_at, overlap, finalize


def _all(rank, world):
    return {
        "exchange": _exchange(rank, world),
        "agreement": {(w, f, o): _sparse_agreement(rank, world, w, f, o)
                      for w, f, o in [("sparse2", 1, 0), ("sparse4", 2, 1)]},
        "resume": {name: (_resume(rank, world, 12, 12, o, fin), _resume(rank, world, stop, 12, o, fin))
                   for name, (stop, o, fin) in RESUME_CASES.items()},
    }


@pytest.fixture(scope="module")
def ranks():
    return run_ranks(_all, WORLD)


def test_exchange_sums_every_ranks_decoded_buffer_by_tokens_identically_everywhere(ranks):
    codec = SparseCodec("sparse2", 2)
    n = 2 * CHUNK + 100
    outs = [r["exchange"][0] for r in ranks]
    assert all(o.tobytes() == outs[0].tobytes() for o in outs)  # bit-identical on every rank
    expected = torch.zeros(n)
    for r in range(WORLD):  # by hand: decode each rank's buffer, weigh by its tokens (8, 16, 24 of 48)
        values, tokens = codec.decode(torch.from_numpy(ranks[r]["exchange"][2]), n)
        assert tokens == 8.0 * (r + 1)
        expected += values * (tokens / 48.0)
    assert torch.equal(torch.from_numpy(outs[0]), expected)
    for r in ranks:  # the bytes counted: this rank's buffer, to each of the other ranks
        assert r["exchange"][1] == (WORLD - 1) * r["exchange"][2].size == (WORLD - 1) * sparse_nbytes(n, 2)


@pytest.mark.parametrize("case", [("sparse2", 1, 0), ("sparse4", 2, 1)])
def test_every_rank_holds_identical_global_weights_after_every_sync(ranks, case):
    wire, fragments, overlap = case
    logs = [r["agreement"][case] for r in ranks]
    outer = set()
    for per_step in zip(*(log for log, *_ in logs)):
        step = per_step[0][0]
        assert all(p[1] == per_step[0][1] for p in per_step), f"global weights differ at step {step}"
        outer.add(per_step[0][2])
        residuals = [p[3] for p in per_step]
        if per_step[0][2] > 0:  # each rank keeps its own residual: they differ (the check above can fail)
            assert len({tuple(r) for r in residuals}) == WORLD
    assert max(outer) == 3 * fragments
    _, nbytes, numels, _ = logs[0]
    # Every sync sent this rank's buffer to 2 peers and agreed on its outcome (a one-integer
    # all-reduce per sync), and nothing else was sent (beyond set-up's weight hashes: 8 + 96 bytes
    # to each peer).
    assert all(r["agreement"][case][1] == nbytes for r in ranks)
    syncs = 3 * fragments
    assert nbytes == ((WORLD - 1) * (8 + 96) + syncs * ring_allreduce_bytes(4, WORLD)
                      + 3 * sum((WORLD - 1) * sparse_nbytes(n, int(wire[-1])) for n in numels))


@pytest.mark.parametrize("name", list(RESUME_CASES))
def test_resume_mid_round_equals_a_straight_run(ranks, name):
    straight = [r["resume"][name][0] for r in ranks]
    resumed = [r["resume"][name][1] for r in ranks]
    assert all(s[:2] == straight[0][:2] for s in straight)  # ranks agree on the weights
    assert resumed == straight  # model, global weights and every rank's residual, hash for hash


# -- the planner's byte and memory estimates ------------------------------------------------------


def test_the_plan_counts_the_sparse_wires_bytes_as_the_strategy_sends_them():
    from vpscluster.plan import memory, predict
    from vpscluster.train.strategies import sync_rule
    from vpscluster.plan.shapes import load_model

    model = load_model("small")
    p = model.num_params()
    for wire, bits in (("sparse2", 2), ("sparse4", 4)):
        for world in (2, 4):
            sent = (world - 1) * sparse_nbytes(p, bits)  # one buffer to each peer (a fragment: F = 1)
            traffic = predict.sync_traffic(predict.Settings(name="diloco", wire_dtype=wire), model, world)
            assert predict.bytes_sent(traffic, world) == sent
            assert sync_rule.sync_bytes(p, world, wire) == pytest.approx(sent, rel=1e-3)  # whole chunks aside
        # 4 ranks: 3 gathered buffers of ~0.03 bytes/value against a ring of 1.5 x 1.004: 15-17x fewer.
        assert sync_rule.sync_bytes(p, 4, wire) < sync_rule.sync_bytes(p, 4, "int8") / 15
        est = memory.estimate(model, "diloco", 4, mixed_precision=False, wire_dtype=wire)
        assert est.components["diloco_error_feedback"] == 4.0 * p
