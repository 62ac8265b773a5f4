"""Communication cost: ring order, α–β ring collectives, DDP bucket overlap, traffic per strategy.

Ring all-reduce (Patarasuk & Yuan, 2009; Thakur et al., 2005): reduce-scatter then all-gather,
2(n-1) steps, each sending S/n bytes to the next rank at the same time. Every step waits for the
slowest transfer, so the ring runs at the pace of its weakest link:

    T_allreduce(S) = 2(n-1) * (alpha + S / (n * beta_min))
    T_allgather(c) = (n-1) * (alpha + c / beta_min)          (c = each rank's chunk)

with alpha the one-way latency of the slowest hop plus a software overhead, and beta_min the
bandwidth (bytes/s) of the ring's weakest directed link. Choosing the ring order is a bottleneck
travelling-salesman problem: exact by enumeration up to 8 nodes, widest-neighbour construction
plus 2-opt above (maximising the weakest link first, then the sum of link rates).

DDP overlap (Li et al., 2020, "PyTorch Distributed", VLDB): gradients are all-reduced in buckets
of bucket_mb MiB as backward produces them, one collective after another, so only what is left
after backward is exposed. Simulated here bucket by bucket.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from vpscluster.plan.resources import LinkMatrix
from vpscluster.plan.shapes import ModelSpec

SOFTWARE_ALPHA_S = 2e-4  # per-message overhead of gloo/TCP on top of the one-way latency
EXACT_RING_MAX_NODES = 8


@dataclass(frozen=True)
class Ring:
    order: tuple[int, ...]
    weakest_mbit: float  # bandwidth of the ring's slowest directed link
    alpha_s: float  # per-step latency: slowest hop's one-way delay + software overhead

    @property
    def beta_bytes_s(self) -> float:
        return self.weakest_mbit * 1e6 / 8

    def allreduce_seconds(self, nbytes: float, world_size: int | None = None) -> float:
        n = world_size or len(self.order)
        if n <= 1 or nbytes <= 0:
            return 0.0
        return 2 * (n - 1) * (self.alpha_s + nbytes / (n * self.beta_bytes_s))

    def allgather_seconds(self, chunk_bytes: float, world_size: int | None = None) -> float:
        n = world_size or len(self.order)
        if n <= 1 or chunk_bytes <= 0:
            return 0.0
        return (n - 1) * (self.alpha_s + chunk_bytes / self.beta_bytes_s)


def ring_links(order: tuple[int, ...]) -> list[tuple[int, int]]:
    return [(order[k], order[(k + 1) % len(order)]) for k in range(len(order))]


def make_ring(links: LinkMatrix, order: tuple[int, ...]) -> Ring:
    if len(order) <= 1:
        return Ring(tuple(order), math.inf, 0.0)
    hops = ring_links(order)
    weakest = min(links.bandwidth_mbit[i][j] for i, j in hops)
    one_way_s = max(links.rtt_ms[i][j] for i, j in hops) / 2 / 1000
    return Ring(tuple(order), weakest, one_way_s + SOFTWARE_ALPHA_S)


def best_ring(links: LinkMatrix) -> Ring:
    """The ring order whose weakest link is strongest (ties: the larger total bandwidth)."""
    n = len(links.names)
    if n <= 2:
        return make_ring(links, tuple(range(n)))

    def score(order) -> tuple[float, float]:
        bws = [links.bandwidth_mbit[i][j] for i, j in ring_links(order)]
        return (min(bws), sum(bws))

    if n <= EXACT_RING_MAX_NODES:
        # Fix node 0 first: rotations of a ring are the same ring.
        best = max(((0, *rest) for rest in itertools.permutations(range(1, n))), key=score)
        return make_ring(links, best)
    candidates = []
    for start in range(n):
        order, left = [start], set(range(n)) - {start}
        while left:
            nxt = max(left, key=lambda j: links.bandwidth_mbit[order[-1]][j])
            order.append(nxt)
            left.remove(nxt)
        candidates.append(_two_opt(order, score))
    return make_ring(links, tuple(max(candidates, key=score)))


def _two_opt(order: list[int], score) -> tuple[int, ...]:
    best, best_score = tuple(order), score(order)
    improved = True
    while improved:
        improved = False
        for i in range(1, len(best) - 1):
            for j in range(i + 1, len(best)):
                cand = best[:i] + tuple(reversed(best[i:j + 1])) + best[j + 1:]
                s = score(cand)
                if s > best_score:
                    best, best_score, improved = cand, s, True
    return best


# --- what each strategy puts on the wire ------------------------------------------------------


def backward_params(model: ModelSpec) -> list[tuple[int, float]]:
    """(elements, fraction of backward done when its gradient is final), in backward order.

    vpscluster's GPT registers tok_emb, pos_emb, then per block ln1, attn.qkv, attn.proj, ln2,
    mlp.fc (mlp.gate), mlp.proj, then ln_f; backward runs the other way: the output head, the
    blocks from the last to the first, then the embeddings. Each parameter's gradient is final
    once the backward of its op is done; time is spread by the ops' FLOPs (matmuls: 2 x weight
    elements per token for the backward, attention scores 8 * d * s per token). The tied
    embedding's gradient is final only at the very end.
    """
    s = model.shape
    d, f, seq = s.d_model, s.d_ff, s.seq_len
    head = 2 * 2 * s.vocab_size * d  # backward matmul FLOPs per token (input and weight grads)
    mlp = [("proj", d * f, d)] + ([("gate", f * d, f)] if s.gated_mlp else []) + [("fc", f * d, f)]
    block_ops = [(w, b) for _, w, b in mlp] + [(d * 0, 2 * d), (d * d, d), (3 * d * d, 3 * d), (0, 2 * d)]
    # (weight elements, bias/norm elements) per op in backward order: mlp.proj, [gate], fc, ln2,
    # attn.proj (+ the attention itself), attn.qkv, ln1.
    attn_flops = 8 * d * seq
    per_block = sum(4 * w for w, _ in block_ops) + attn_flops
    total = head + s.n_layer * per_block
    out: list[tuple[int, float]] = []
    t = head
    out.append((2 * d + (s.vocab_size * d if model.untied_head else 0), t / total))  # ln_f (+ untied head)
    for _ in range(s.n_layer):
        for k, (w, b) in enumerate(block_ops):
            t += 4 * w + (attn_flops if k == len(mlp) + 1 else 0)
            out.append((w + b, t / total))
    out.append((s.vocab_size * d + seq * d, 1.0))  # tok_emb (tied) and pos_emb
    return [(n, min(1.0, r)) for n, r in out if n > 0]


def grad_buckets(model: ModelSpec, grad_bytes_per_param: float, bucket_mb: float) -> list[tuple[float, float]]:
    """DDP buckets in backward order: (bytes, fraction of backward done when the bucket is ready).

    As torch's reducer assigns them (after its first-iteration rebuild, by gradient ready
    order): parameters in backward order fill a bucket until it reaches its cap. torch 2.x uses
    a 1 MiB first bucket only when `bucket_cap_mb` is left at its default; vpscluster's DDP
    strategy always passes `bucket_mb`, so every bucket (the first too) is `bucket_mb` MiB, and a
    model smaller than that is one bucket, reduced only after the whole backward.
    """
    buckets, cap = [], bucket_mb * 2**20
    size, ready = 0.0, 0.0
    for params, done in backward_params(model):
        size += params * grad_bytes_per_param
        ready = done
        if size >= cap:
            buckets.append((size, ready))
            size, cap = 0.0, bucket_mb * 2**20
    if size > 0:
        buckets.append((size, ready))
    return buckets


def ddp_exposed_seconds(ring: Ring, world_size: int, model: ModelSpec, grad_bytes_per_param: float,
                        bucket_mb: float, forward_s: float, backward_s: float) -> tuple[float, float]:
    """(exposed comm seconds after backward, total collective busy seconds) for one DDP step."""
    t_end, busy = 0.0, 0.0
    for nbytes, done in grad_buckets(model, grad_bytes_per_param, bucket_mb):
        ready = forward_s + done * backward_s
        seconds = ring.allreduce_seconds(nbytes, world_size)
        t_end = max(t_end, ready) + seconds
        busy += seconds
    return max(0.0, t_end - (forward_s + backward_s)), busy


def alltoall_seconds(links: LinkMatrix, nbytes: float, world_size: int) -> float:
    """All-to-all of an `nbytes` buffer: every rank sends nbytes/n to each other rank at once.

    The flows of one node share its link (a VPS has one NIC with one rate cap), so a node needs
    the sum of its per-peer transfer times; the busiest sender or receiver sets the pace.
    """
    n = len(links.names)
    if n <= 1 or nbytes <= 0:
        return 0.0
    piece = nbytes / world_size
    rate = [[b * 1e6 / 8 for b in row] for row in links.bandwidth_mbit]
    send = max(sum(piece / rate[i][j] for j in range(n) if j != i) for i in range(n))
    recv = max(sum(piece / rate[i][j] for i in range(n) if i != j) for j in range(n))
    alpha = max(links.rtt_ms[i][j] for i in range(n) for j in range(n) if i != j) / 2 / 1000 + SOFTWARE_ALPHA_S
    return alpha + max(send, recv)
