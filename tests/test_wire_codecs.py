"""Wire encodings of the pseudo-gradient: round-trip error bounds, sizes, and the fp32-accumulating
all-reduce on real gloo ranks (bytes counted from the buffers actually sent)."""

from __future__ import annotations

import pytest
import torch

from test_diloco_strategy import run_ranks
from vpscluster.errors import UserError
from vpscluster.train.strategies.base import CommStats
from vpscluster.train.strategies.wire import INT8_BLOCK, all_reduce_sum, get_codec


def spread_tensor(numel: int, seed: int = 0) -> torch.Tensor:
    """Values whose magnitude varies by orders of magnitude from block to block."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(numel, generator=g)
    scales = 10.0 ** torch.randint(-4, 3, (numel // INT8_BLOCK + 1,), generator=g).float()
    return x * scales.repeat_interleave(INT8_BLOCK)[:numel]


def test_int8_round_trip_error_is_at_most_half_a_step_of_its_block():
    codec = get_codec("int8")
    x = spread_tensor(16 * INT8_BLOCK)
    x[3 * INT8_BLOCK : 4 * INT8_BLOCK] = 0.0  # an all-zero block must survive (no 0/0)
    data = codec.encode(x)
    assert data.dtype == torch.uint8 and data.numel() == codec.encoded_nbytes(x.numel())
    y = codec.decode(data, x.numel())
    err = (y - x).abs().reshape(-1, INT8_BLOCK)
    bound = x.abs().reshape(-1, INT8_BLOCK).amax(1) / 254
    assert torch.all(err.amax(1) <= bound * (1 + 1e-5) + 1e-30)
    assert torch.all(y[3 * INT8_BLOCK : 4 * INT8_BLOCK] == 0)
    # The bound is tight (not vacuous): some value is off by more than a quarter step.
    assert torch.any(err.amax(1) > bound / 2)


def test_bf16_round_trip_is_relative_and_fp32_is_exact():
    x = spread_tensor(4 * INT8_BLOCK, seed=1)
    bf = get_codec("bf16")
    y = bf.decode(bf.encode(x), x.numel())
    assert torch.all((y - x).abs() <= x.abs() * 2.0**-8)
    fp = get_codec("fp32")
    assert torch.equal(fp.decode(fp.encode(x), x.numel()), x)


def test_encoded_sizes_half_and_quarter_of_fp32():
    n = 64 * INT8_BLOCK
    fp32, bf16, int8 = (get_codec(name).encoded_nbytes(n) for name in ("fp32", "bf16", "int8"))
    assert bf16 * 2 == fp32
    assert 0.25 < int8 / fp32 <= 0.25 + 1 / INT8_BLOCK  # int8 values + one fp32 scale per block


def test_unknown_wire_dtype_names_the_choices():
    with pytest.raises(UserError, match="fp32, bf16, int8"):
        get_codec("fp8")


def _reduce(rank, world, numel):
    from vpscluster.train.strategies.base import CommStats

    out = {}
    x = spread_tensor(numel, seed=10 + rank)
    # Overflow probe: every rank puts the block's absmax in block 0, so the int8 codes are all
    # ±127 and their sum (127 * world) does not fit in int8; fp32 accumulation gets it right.
    x[:INT8_BLOCK] = 100.0
    for name in ("fp32", "bf16", "int8"):
        comm = CommStats()
        result = all_reduce_sum(x, get_codec(name), comm, world)
        sent_unaligned = comm.take()[1]
        # Byte ratios on a tensor that needs no padding (the real model's 10M values make the
        # padding to world * block negligible; here it would dominate).
        all_reduce_sum(spread_tensor(4 * world * INT8_BLOCK), get_codec(name), comm, world)
        out[name] = (result, comm.take()[1], sent_unaligned)
    return x, out


@pytest.mark.parametrize("world", [2, 3])
def test_all_reduce_sums_in_fp32_identically_everywhere_and_counts_bytes(world):
    numel = 5 * INT8_BLOCK + 77  # not a multiple of world * block: padding is exercised
    ranks = run_ranks(_reduce, world, numel)
    inputs = [torch.from_numpy(x) for x, _ in ranks]
    exact = torch.stack(inputs).sum(0)
    for name in ("fp32", "bf16", "int8"):
        results = [torch.from_numpy(out[name][0]) for _, out in ranks]
        for r in results[1:]:
            assert torch.equal(r, results[0]), f"{name}: ranks disagree"
        got = results[0]
        assert torch.allclose(got[:INT8_BLOCK], torch.full((INT8_BLOCK,), 100.0 * world))
        if name == "fp32":
            torch.testing.assert_close(got, exact, rtol=1e-6, atol=1e-6)
        elif name == "int8":
            # Each contribution is off by at most absmax/254 of its block, the reduced chunk once more.
            def block_max(t):
                pad = torch.zeros(-(-numel // INT8_BLOCK) * INT8_BLOCK)
                pad[:numel] = t.abs()
                return pad.reshape(-1, INT8_BLOCK).amax(1)

            bound = (sum(block_max(x) for x in inputs) + block_max(exact)) / 254
            err = torch.zeros(bound.numel() * INT8_BLOCK)
            err[:numel] = (got - exact).abs()
            assert torch.all(err.reshape(-1, INT8_BLOCK).amax(1) <= bound * (1 + 1e-5))
    fp32_bytes = ranks[0][1]["fp32"][1]
    assert fp32_bytes > 0
    for _, out in ranks:
        assert out["fp32"][1] == fp32_bytes  # every rank sends the same
        assert out["bf16"][1] * 2 == fp32_bytes
        assert 0.25 < out["int8"][1] / fp32_bytes <= 0.25 + 1 / INT8_BLOCK
        # Unaligned: each phase sends (world-1) encoded chunks of the padded tensor.
        padded = -(-numel // (world * INT8_BLOCK)) * world * INT8_BLOCK
        assert out["int8"][2] == 2 * (world - 1) * get_codec("int8").encoded_nbytes(padded // world)
        assert out["fp32"][2] == 2 * (world - 1) * 4 * (-(-numel // world))


def test_world_of_one_sends_nothing():
    from vpscluster.train.strategies.base import CommStats

    comm = CommStats()
    x = spread_tensor(100)
    assert torch.equal(all_reduce_sum(x, get_codec("int8"), comm, 1), x)
    assert comm.take() == (0.0, 0)


@pytest.mark.parametrize("name", ["fp32", "bf16", "int8"])
def test_local_only_does_the_ranks_work_without_the_network(name):
    """local_only (the plan's timing of a sync): no process group; this rank's own encoded
    bytes stand in for what it would receive, so it decodes and sums `world` chunks and decodes
    `world` gathered ones - the same work - and the result is the sum of its own chunks, repeated."""
    world = 3
    x = spread_tensor(4 * world * INT8_BLOCK)
    comm = CommStats()
    codec = get_codec(name)
    out = all_reduce_sum(x, codec, comm, world, local_only=True)
    chunks = [codec.decode(codec.encode(c), c.numel()) for c in x.split(x.numel() // world)]
    summed = codec.decode(codec.encode(sum(chunks)), chunks[0].numel())
    assert out.shape == x.shape and torch.allclose(out, torch.cat([summed] * world), atol=1e-6)
    assert comm.bytes_sent == 2 * (world - 1) * codec.encoded_nbytes(x.numel() // world)
