"""Sparse, low-bit pseudo-gradients with error feedback: a DiLoCo wire (`--wire-dtype sparse2|sparse4`).

SparseLoCo (Sarfi et al., 2025, arXiv:2508.15706; as run for Covenant-72B) sends, per worker,
the top ~1.5% of each chunk of the pseudo-gradient in 2 bits and keeps what it did not send in a
per-worker error-feedback buffer that is added to the next pseudo-gradient. Here, per fragment:

    acc  = e + Δ_r                          (e: this rank's residual, fp32, starts at 0)
    sent = decode(encode(acc))              (top-k of each chunk, quantized)
    e    = acc − sent                       (only once the sync has landed; a skipped sync
                                             leaves e as it was: the next Δ_r covers the round)

The encoding of n values: cut into chunks of CHUNK values (the last one zero-padded), keep the
K largest magnitudes of each chunk (torch.topk), and send per chunk two fp32 scales, lo and hi
(the smallest and largest kept magnitude), each kept value as a sign bit plus a (bits − 1)-bit
level on the uniform grid lo + j·(hi − lo)/(2^(bits−1) − 1), and its index in the chunk in
ceil(log2(CHUNK)) bits. Indices and codes are bit-packed, LSB first. A kept value decodes to
within half a grid step, (hi − lo)/(2·(2^(bits−1) − 1)), of itself; its index exactly; every other
value decodes to 0. The buffer also starts with this rank's token count (float64), so one
collective carries everything:

    nbytes(n) = 8 + 8·C + ceil(C·K·ceil(log2 CHUNK)/8) + ceil(C·K·bits/8),   C = ceil(n / CHUNK)

With CHUNK = 4096 and K = 64 (1.56%), that is 120 bytes per 4096 values at 2 bits (0.029 bytes
per value: 34× fewer than int8's 1.004, 137× fewer than fp32) and 136 at 4 bits.

Exchange: top-k picks different indices on every rank, so the sparse buffers cannot be summed on
the wire; every rank all-gathers every rank's buffer (equal sizes: the same n and K everywhere,
so `all_gather` works on gloo and NCCL alike), decodes them in rank order and sums
(tokens_r / Σ tokens)·sent_r in fp32. All ranks decode the same bytes in the same order: the
result is bit-identical everywhere. A rank sends its buffer to world − 1 peers; that is the count.
All-gather sends (world − 1)·nbytes per rank against a ring all-reduce's 2·(world − 1)/world
of a dense buffer, so it stays far below int8 for the few replicas DiLoCo runs (at 2 bits it
is cheaper than int8's ring below ~70 ranks).

Only the arithmetic of sizes is importable without torch (the planner uses it).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from vpscluster.train.strategies.base import CommStats

CHUNK = 4096
TOP_K = 64  # per chunk: 1.5625%, SparseLoCo's fraction
SPARSE_WIRES = {"sparse2": 2, "sparse4": 4}  # wire name -> bits per kept value (sign included)
HEADER_BYTES = 8  # the rank's token count, float64


def index_bits(chunk: int) -> int:
    return max(1, math.ceil(math.log2(chunk)))


def sparse_nbytes(numel: int, bits: int, chunk: int = CHUNK, k: int = TOP_K) -> int:
    """Bytes of one rank's buffer for `numel` values (the formula in the module's note)."""
    c = -(-numel // chunk)
    return HEADER_BYTES + 8 * c + -(-c * k * index_bits(chunk) // 8) + -(-c * k * bits // 8)


def bytes_per_param(wire: str, chunk: int = CHUNK, k: int = TOP_K) -> float:
    """Buffer bytes per pseudo-gradient value, chunk scales included (the header left out)."""
    bits = SPARSE_WIRES[wire]
    return (8 + k * (index_bits(chunk) + bits) / 8) / chunk


def sync_bytes(num_params: float, world_size: int, wire: str) -> float:
    """Bytes one rank sends in one outer sync: its buffer to each of the world − 1 peers."""
    if world_size <= 1:
        return 0.0
    return (world_size - 1) * (HEADER_BYTES + num_params * bytes_per_param(wire))


def pack_bits(values: "torch.Tensor", bits: int) -> "torch.Tensor":
    """Non-negative integers < 2**bits -> ceil(len·bits/8) uint8 bytes, LSB first."""
    import torch

    shifts = torch.arange(bits, dtype=torch.int64)
    stream = ((values.to(torch.int64)[:, None] >> shifts) & 1).to(torch.uint8).reshape(-1)
    pad = (-stream.numel()) % 8
    if pad:
        stream = torch.cat([stream, torch.zeros(pad, dtype=torch.uint8)])
    weights = (1 << torch.arange(8, dtype=torch.int32))
    return (stream.reshape(-1, 8).to(torch.int32) * weights).sum(1).to(torch.uint8)


def unpack_bits(data: "torch.Tensor", count: int, bits: int) -> "torch.Tensor":
    """The inverse of `pack_bits`: `count` int64 values."""
    import torch

    stream = ((data.to(torch.int64)[:, None] >> torch.arange(8, dtype=torch.int64)) & 1).reshape(-1)
    return (stream[: count * bits].reshape(count, bits) << torch.arange(bits, dtype=torch.int64)).sum(1)


class SparseCodec:
    """Chunked top-k, sign + (bits − 1)-bit magnitude between per-chunk lo/hi scales."""

    def __init__(self, name: str, bits: int, chunk: int = CHUNK, k: int = TOP_K) -> None:
        if bits < 2 or not 0 < k <= chunk:
            raise ValueError(f"sparse wire needs bits >= 2 and 0 < k <= chunk, got {bits}, {k}, {chunk}")
        self.name, self.bits, self.chunk, self.k = name, bits, chunk, k
        self.levels = 2 ** (bits - 1)  # magnitude levels per sign
        self.ibits = index_bits(chunk)

    def encoded_nbytes(self, numel: int) -> int:
        return sparse_nbytes(numel, self.bits, self.chunk, self.k)

    def _layout(self, numel: int) -> tuple[int, int, int]:
        c = -(-numel // self.chunk)
        return c, -(-c * self.k * self.ibits // 8), -(-c * self.k * self.bits // 8)

    def encode(self, x: "torch.Tensor", tokens: float = 0.0) -> "torch.Tensor":
        """fp32 values (and this rank's token count) -> `encoded_nbytes(x.numel())` uint8 bytes."""
        import torch

        n = x.numel()
        c, _, _ = self._layout(n)
        padded = torch.zeros(c * self.chunk, dtype=torch.float32)
        padded[:n] = x.reshape(-1)
        chunks = padded.reshape(c, self.chunk)
        mag, idx = chunks.abs().topk(self.k, dim=1, sorted=False)
        vals = chunks.gather(1, idx)
        lo, hi = mag.amin(1), mag.amax(1)
        span = hi - lo
        step = torch.where(span > 0, span / (self.levels - 1), torch.ones_like(span))
        level = torch.round((mag - lo[:, None]) / step[:, None]).clamp_(0, self.levels - 1).to(torch.int64)
        code = ((vals < 0).to(torch.int64) << (self.bits - 1)) | level
        header = torch.tensor([float(tokens)], dtype=torch.float64).view(torch.uint8)
        scales = torch.stack([lo, hi], dim=1).reshape(-1).contiguous().view(torch.uint8)
        return torch.cat([header, scales, pack_bits(idx.reshape(-1), self.ibits), pack_bits(code.reshape(-1), self.bits)])

    def decode(self, data: "torch.Tensor", numel: int) -> tuple["torch.Tensor", float]:
        """uint8 bytes -> (fp32 values, a new tensor of `numel`; the sender's token count)."""
        import torch

        c, ib, vb = self._layout(numel)
        tokens = float(data[:HEADER_BYTES].clone().view(torch.float64).item())
        o = HEADER_BYTES
        scales = data[o : o + 8 * c].clone().view(torch.float32).reshape(c, 2)
        o += 8 * c
        idx = unpack_bits(data[o : o + ib], c * self.k, self.ibits).reshape(c, self.k)
        code = unpack_bits(data[o + ib : o + ib + vb], c * self.k, self.bits).reshape(c, self.k)
        lo, hi = scales[:, 0], scales[:, 1]
        span = hi - lo
        step = torch.where(span > 0, span / (self.levels - 1), torch.ones_like(span))
        level = (code & (self.levels - 1)).to(torch.float32)
        mag = lo[:, None] + level * step[:, None]
        vals = torch.where((code >> (self.bits - 1)) == 1, -mag, mag)
        out = torch.zeros(c, self.chunk, dtype=torch.float32)
        out.scatter_(1, idx, vals)
        return out.reshape(-1)[:numel].clone(), tokens


def wire_codec(name: str):
    """The codec of a wire name: a SparseCodec for `sparse2`/`sparse4`, else `wire.get_codec`'s."""
    from vpscluster.train.strategies.wire import get_codec

    bits = SPARSE_WIRES.get(name)
    return SparseCodec(name, bits) if bits else get_codec(name)


class ErrorFeedback:
    """This rank's residual e per fragment, and the next residual of each sync not yet landed."""

    def __init__(self, numels: list[int]) -> None:
        import torch

        self.residual = [torch.zeros(n, dtype=torch.float32) for n in numels]
        self.pending: dict[int, "torch.Tensor"] = {}  # fragment -> acc − sent, once its sync lands

    def accumulate(self, f: int, delta: "torch.Tensor", codec: SparseCodec) -> "torch.Tensor":
        """acc = e + Δ_r, what this sync encodes; acc − decode(encode(acc)) waits for it to land
        (computed now, with the codec that sends it: a retune may change the wire meanwhile)."""
        acc = self.residual[f] + delta
        self.pending[f] = acc - codec.decode(codec.encode(acc), acc.numel())[0]
        return acc

    def landed(self, f: int) -> None:
        """The sync of fragment f was applied: e = what it did not send."""
        if f in self.pending:
            self.residual[f] = self.pending.pop(f)

    def skipped(self, f: int) -> None:
        """The sync was skipped: e stays; the next Δ_r covers this round again."""
        self.pending.pop(f, None)

    def state_dict(self) -> dict[str, Any]:
        return {"residual": [r.clone() for r in self.residual],
                "pending": {int(f): a.clone() for f, a in self.pending.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        numels = [r.numel() for r in self.residual]
        if [int(r.numel()) for r in state["residual"]] != numels:
            raise ValueError(f"sparse wire residuals {[r.numel() for r in state['residual']]} do not match {numels}")
        self.residual = [r.to("cpu", copy=True) for r in state["residual"]]
        self.pending = {int(f): a.to("cpu", copy=True) for f, a in state["pending"].items()}


def all_gather_sum(
    acc: "torch.Tensor",
    my_tokens: float,
    codec: SparseCodec,
    comm: "CommStats",
    world_size: int,
    comm_device: "torch.device | str" = "cpu",
    group=None,
) -> "torch.Tensor":
    """Σ_r (tokens_r / Σ tokens)·decode(encode(acc_r)) over all ranks, in fp32, rank order.

    One `all_gather` of every rank's buffer; the result is bit-identical on every rank. Counts
    (world − 1) × this rank's buffer as sent in `comm`. Ranks that report no tokens at all are
    weighed equally.
    """
    import torch
    import torch.distributed as dist

    numel = acc.numel()
    mine = codec.encode(acc, my_tokens).to(comm_device)
    gathered = [torch.empty_like(mine) for _ in range(world_size)]
    with comm.timed((world_size - 1) * mine.numel()):
        dist.all_gather(gathered, mine, group=group)
    decoded = [codec.decode(g.cpu(), numel) for g in gathered]
    total = 0.0
    for _, tokens in decoded:  # float64, rank order: the same total everywhere
        total += tokens
    out = torch.zeros(numel, dtype=torch.float32)
    for values, tokens in decoded:
        weight = tokens / total if total > 0 else 1.0 / world_size
        out += values * weight
    return out
