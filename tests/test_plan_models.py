"""Plan cost models against hand-computed cases: memory, ring order, α–β times, traffic."""

from __future__ import annotations

import math

import pytest

from vpscluster.plan import comm, memory
from vpscluster.plan.predict import Settings, bytes_sent, sync_traffic
from vpscluster.plan.resources import LinkMatrix
from vpscluster.plan.shapes import load_model

MIB = 2**20


# --- memory -----------------------------------------------------------------------------------

def test_model_states_are_16_bytes_per_param_for_adam_fp32_and_mixed_precision():
    p = 1_000_000
    mixed = memory.model_state_bytes(p, mixed_precision=True)
    assert mixed == {"weights": 2 * p, "gradients": 2 * p, "optimizer": 12 * p}
    assert sum(mixed.values()) == 16 * p
    assert sum(memory.model_state_bytes(p, mixed_precision=False).values()) == 16 * p


def test_ddp_single_rank_memory_by_hand_for_tiny():
    model = load_model("tiny")  # d 128, 5 layers, seq 128, batch 16, vocab 256, d_ff 512
    p = model.num_params()
    est = memory.estimate(model, "ddp", 1, mixed_precision=False)
    c = est.components
    assert c["weights"] + c["gradients"] + c["optimizer"] == 16 * p
    tokens = 16 * 128
    per_token_layer = 8 * 128 + 2 * 512  # Korthikanti et al. without dropout, flash attention
    assert c["activations"] == 5 * tokens * per_token_layer * 4 + tokens * 256 * (4 + 4) + tokens * 128 * 4
    assert "ddp_buckets" not in c  # one rank: no DDP
    assert est.total_bytes == 16 * p + c["activations"] + memory.RUNTIME_BYTES["ram"]


def test_diloco_keeps_global_copy_momentum_and_sync_buffers():
    model = load_model("small")
    p = model.num_params()
    ddp = memory.estimate(model, "ddp", 4, mixed_precision=False).components
    dl = memory.estimate(model, "diloco", 4, mixed_precision=False).components
    assert dl["diloco_global_weights"] == 4 * p and dl["diloco_outer_momentum"] == 4 * p
    assert dl["diloco_sync_buffers"] == 4 * p  # fp32 pseudo-gradient, reduced in place
    assert "ddp_buckets" not in ddp  # gradient_as_bucket_view: buckets are the gradients
    assert memory.estimate(model, "ddp", 4, mixed_precision=False, compress="bf16").components["ddp_wire_buffers"] == 2 * p
    int8 = memory.estimate(model, "diloco", 4, mixed_precision=False, wire_dtype="int8").components
    assert int8["diloco_sync_buffers"] == (4 + 4 * 1) * p  # + every rank's int8 copy
    two_frag = memory.estimate(model, "diloco", 4, mixed_precision=False, fragments=2).components
    assert two_frag["diloco_sync_buffers"] == 2 * p


def test_sharding_divides_states_and_checkpointing_shrinks_activations():
    model = load_model("350m")
    n = 8
    p = model.num_params()
    none = memory.estimate(model, "ddp", n, mixed_precision=True, memory_kind="gpu").components
    z1 = memory.estimate(model, "ddp", n, mixed_precision=True, memory_kind="gpu",
                         option=memory.MemoryOption(sharding="zero1")).components
    fsdp = memory.estimate(model, "ddp", n, mixed_precision=True, memory_kind="gpu",
                           option=memory.MemoryOption(sharding="fsdp")).components
    assert none["optimizer"] == 12 * p and z1["optimizer"] == 12 * p / n
    assert fsdp["weights"] == 2 * p / n and fsdp["gradients"] == 2 * p / n
    ckpt = memory.estimate(model, "ddp", n, mixed_precision=True, memory_kind="gpu",
                           option=memory.MemoryOption(checkpointing=True)).components
    s = model.shape
    tokens = s.batch_size * s.seq_len
    layer = tokens * (8 * s.d_model + 2 * s.d_ff) * 2
    head_and_embed = tokens * s.vocab_size * (2 + 4) + tokens * s.d_model * 2
    assert none["activations"] == s.n_layer * layer + head_and_embed
    # Checkpointing keeps each layer's input plus one layer being recomputed.
    assert ckpt["activations"] == s.n_layer * tokens * s.d_model * 2 + layer + head_and_embed


def test_fitting_options_suggest_a_layout_when_the_default_does_not_fit():
    model = load_model("1.3b")
    need = memory.estimate(model, "ddp", 4, mixed_precision=True, memory_kind="gpu").total_bytes
    fits = memory.fitting_options(model, "ddp", 4, need * 0.6, mixed_precision=True, memory_kind="gpu")
    assert fits, "some layout (checkpointing, micro-batch, sharding) must fit in 60% of the default"
    assert all(est.total_bytes <= need * 0.6 * memory.HEADROOM for _, est in fits)
    assert memory.MemoryOption() not in [o for o, _ in fits]


# --- ring order and α–β --------------------------------------------------------------------------

def _matrix(n, fast=1000.0, slow=None, rtt=1.0):
    links = LinkMatrix.uniform([f"n{i}" for i in range(n)], fast, rtt)
    for (i, j), v in (slow or {}).items():
        links.bandwidth_mbit[i][j] = v
    return links


@pytest.mark.parametrize("n", [4, 5, 10])
def test_ring_avoids_one_slow_link(n):
    links = _matrix(n, slow={(0, 1): 10.0, (1, 0): 10.0})
    ring = comm.best_ring(links)
    assert ring.weakest_mbit == 1000.0
    assert (0, 1) not in comm.ring_links(ring.order) and (1, 0) not in comm.ring_links(ring.order)
    assert sorted(ring.order) == list(range(n))


def test_ring_cannot_avoid_a_node_whose_links_are_all_slow():
    links = _matrix(4, slow={(2, j): 50.0 for j in range(4) if j != 2})
    assert comm.best_ring(links).weakest_mbit == 50.0


def test_ring_order_in_a_two_region_cluster_crosses_the_slow_gap_only_twice():
    # Two regions of 3 nodes: 1 Gbit/s inside, 100 Mbit/s between; the best ring crosses twice.
    n = 6
    links = _matrix(n)
    for i in range(n):
        for j in range(n):
            if i != j and (i < 3) != (j < 3):
                links.bandwidth_mbit[i][j] = 100.0
    ring = comm.best_ring(links)
    crossings = sum((i < 3) != (j < 3) for i, j in comm.ring_links(ring.order))
    assert crossings == 2 and ring.weakest_mbit == 100.0


def test_allreduce_time_by_hand():
    links = _matrix(4, fast=100.0, rtt=2.0)
    ring = comm.make_ring(links, (0, 1, 2, 3))
    nbytes = 40e6
    alpha = 1e-3 + comm.SOFTWARE_ALPHA_S
    expected = 2 * 3 * (alpha + nbytes / 4 / (100e6 / 8))
    assert ring.allreduce_seconds(nbytes) == pytest.approx(expected)
    assert ring.allgather_seconds(nbytes / 4) == pytest.approx(3 * (alpha + nbytes / 4 / (100e6 / 8)))
    assert ring.allreduce_seconds(nbytes, 1) == 0.0


def test_ddp_overlap_hides_comm_behind_backward_but_not_the_last_bucket():
    model = load_model("small")
    ring = comm.make_ring(_matrix(2, fast=100.0), (0, 1))
    exposed_long, busy = comm.ddp_exposed_seconds(ring, 2, model, 4.0, 25.0, forward_s=1.0, backward_s=1000.0)
    last = comm.grad_buckets(model, 4.0, 25.0)[-1][0]
    assert exposed_long == pytest.approx(ring.allreduce_seconds(last, 2))
    exposed_none, busy2 = comm.ddp_exposed_seconds(ring, 2, model, 4.0, 25.0, forward_s=0.0, backward_s=0.0)
    assert busy == pytest.approx(busy2) == pytest.approx(exposed_none)
    assert busy == pytest.approx(sum(ring.allreduce_seconds(b, 2) for b, _ in comm.grad_buckets(model, 4.0, 25.0)))
    # Buckets hold every gradient exactly once.
    assert sum(b for b, _ in comm.grad_buckets(model, 4.0, 25.0)) == pytest.approx(4.0 * model.num_params())


# --- traffic ----------------------------------------------------------------------------------

def test_ddp_bytes_per_step():
    model = load_model("small")
    p, n = model.num_params(), 4
    assert bytes_sent(sync_traffic(Settings("ddp"), model, n), n) == pytest.approx(2 * 3 / 4 * 4 * p)
    bf16 = bytes_sent(sync_traffic(Settings("ddp", compress="bf16"), model, n), n)
    assert bf16 == pytest.approx(2 * 3 / 4 * 2 * p)
    psgd = bytes_sent(sync_traffic(Settings("ddp", compress="powersgd", powersgd_rank=4), model, n), n)
    assert psgd < bf16 / 10


@pytest.mark.parametrize("wire", ["fp32", "bf16", "int8"])
@pytest.mark.parametrize("n", [2, 3, 4])
def test_diloco_bytes_match_what_the_wire_module_counts(wire, n):
    """Same arithmetic as train/strategies/wire.all_reduce_sum counts: 2 phases of (n-1) chunks."""
    from vpscluster.train.strategies.base import ring_allreduce_bytes
    from vpscluster.train.strategies.wire import get_codec

    model = load_model("tiny")
    codec = get_codec(wire)
    unit = n * codec.block
    chunk = -(-model.num_params() // unit) * unit // n
    counted = 2 * (n - 1) * codec.encoded_nbytes(chunk) + ring_allreduce_bytes(8, n)
    predicted = bytes_sent(sync_traffic(Settings("diloco", wire_dtype=wire), model, n), n)
    assert predicted == pytest.approx(counted)


def test_alltoall_is_paced_by_the_busiest_node():
    links = _matrix(3, fast=1000.0, slow={(0, 1): 100.0, (0, 2): 100.0}, rtt=0.0)
    t = comm.alltoall_seconds(links, 3e6, 3)
    # Node 0 sends 1 MB to each of two peers at 100 Mbit/s, one after the other on its link.
    assert t == pytest.approx(comm.SOFTWARE_ALPHA_S + 2 * 1e6 / (100e6 / 8))
    assert not math.isnan(t)


def test_diloco_overlap_hides_the_sync_behind_tau_steps_of_compute():
    from vpscluster.plan.predict import diloco_exposed_seconds

    # blocking: a 10 s sync every 50 steps is 0.2 s per step, all of it exposed
    assert diloco_exposed_seconds(10.0, 0.0, 4, 50, 1, 0, 1.0) == pytest.approx((0.2, 0.2))
    # τ = 1 with 1 s steps: 9 s of it outlasts the step it hides behind
    assert diloco_exposed_seconds(10.0, 0.0, 4, 50, 1, 1, 1.0) == pytest.approx((9.0 / 50, 0.2))
    # τ = 2 with 6 s steps: hidden entirely
    assert diloco_exposed_seconds(10.0, 0.0, 4, 50, 1, 2, 6.0) == pytest.approx((0.0, 0.2))
    # 4 fragments of 2.5 s behind τ = 1 of 1 s: 1.5 s late each, 4 per 50 steps
    assert diloco_exposed_seconds(10.0, 0.0, 4, 50, 4, 1, 1.0)[0] == pytest.approx(4 * 1.5 / 50)
    # a sync far longer than the window: the landing step waits for the rest of it (95 s per 10 steps)
    assert diloco_exposed_seconds(100.0, 0.0, 4, 10, 1, 5, 1.0)[0] == pytest.approx(9.5)
    # 5 fragments in flight at once behind τ = 9: the one thread serialises them (10 s per step)
    assert diloco_exposed_seconds(100.0, 0.0, 4, 10, 5, 9, 1.0)[0] == pytest.approx(9.0)
    # fragments add latency rounds: F-1 more, 3 collectives each over n-1 hops
    assert diloco_exposed_seconds(10.0, 0.01, 4, 50, 3, 0, 1.0)[1] == pytest.approx((10.0 + 2 * 3 * 3 * 0.01) / 50)
