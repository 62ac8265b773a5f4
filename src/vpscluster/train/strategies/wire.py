"""Pseudo-gradient encodings for the wire (fp32, bf16, int8) and an all-reduce that sums in fp32.

DiLoCo (Douillard et al., 2023, arXiv:2311.08105) exchanges one pseudo-gradient per outer step.
INTELLECT-1 (Jaghouar et al., 2024, arXiv:2412.01152) sends it as int8 and still accumulates in
fp32: an all-reduce *in* int8 would overflow (two contributions of +100 already do) and lose the
low bits at every hop. So only what crosses the wire is quantized:

1. reduce-scatter by hand: every rank cuts its fp32 tensor into `world` chunks, encodes each and
   sends chunk j to rank j (`all_to_all`); rank j decodes the `world` contributions and sums them
   in fp32, in rank order (deterministic);
2. all-gather: rank j encodes its reduced chunk once and all ranks gather every chunk. Everyone,
   the owner included, uses the *decoded* gathered bytes, so all ranks end bit-identical.

Each phase sends (world-1)/world of the encoded tensor per rank: the same 2(n-1)/n as a ring
all-reduce, times the encoding's bytes per element. The bytes counted are the sizes of the
buffers this rank actually hands to the collectives, minus the chunk it keeps for itself.

int8 uses one fp32 scale per block of `INT8_BLOCK` values (absmax / 127), so the round-trip
error of a value is at most half a quantization step, absmax_of_its_block / 254, and the scales
add 4 / INT8_BLOCK bytes per value (0.4%).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, ClassVar

from vpscluster.errors import UserError

if TYPE_CHECKING:
    import torch

    from vpscluster.train.strategies.base import CommStats

INT8_BLOCK = 1024
INT8_LEVELS = 127  # symmetric: -127..127, so the scale of a block is absmax / 127


class WireCodec(ABC):
    """Turns a 1-D fp32 tensor (length a multiple of `block`) into bytes and back."""

    name: ClassVar[str]
    block: ClassVar[int] = 1  # chunk lengths must be multiples of this

    @abstractmethod
    def encoded_nbytes(self, numel: int) -> int:
        """Size in bytes of `encode` of a tensor of `numel` values."""

    @abstractmethod
    def encode(self, x: "torch.Tensor") -> "torch.Tensor":
        """fp32 values -> a uint8 tensor of `encoded_nbytes(x.numel())` bytes."""

    @abstractmethod
    def decode(self, data: "torch.Tensor", numel: int) -> "torch.Tensor":
        """uint8 bytes -> fp32 values (a new tensor)."""


class Fp32Codec(WireCodec):
    name = "fp32"

    def encoded_nbytes(self, numel: int) -> int:
        return 4 * numel

    def encode(self, x):
        import torch

        return x.to(torch.float32).contiguous().view(torch.uint8)

    def decode(self, data, numel):
        import torch

        return data.view(torch.float32)[:numel].clone()


class Bf16Codec(WireCodec):
    name = "bf16"

    def encoded_nbytes(self, numel: int) -> int:
        return 2 * numel

    def encode(self, x):
        import torch

        return x.to(torch.bfloat16).contiguous().view(torch.uint8)

    def decode(self, data, numel):
        import torch

        return data.view(torch.bfloat16)[:numel].to(torch.float32)


class Int8Codec(WireCodec):
    """Symmetric absmax int8 per block: [int8 values][fp32 scale per block]."""

    name = "int8"
    block = INT8_BLOCK

    def encoded_nbytes(self, numel: int) -> int:
        if numel % self.block:
            raise ValueError(f"int8 encoding needs a multiple of {self.block} values, got {numel}")
        return numel + 4 * (numel // self.block)

    def encode(self, x):
        import torch

        blocks = x.to(torch.float32).reshape(-1, self.block)
        absmax = blocks.abs().amax(dim=1)
        # An all-zero block gets scale 1 (its values quantize to 0 either way), never a 0 divisor.
        scale = torch.where(absmax > 0, absmax / INT8_LEVELS, torch.ones_like(absmax))
        q = torch.round(blocks / scale[:, None]).clamp_(-INT8_LEVELS, INT8_LEVELS).to(torch.int8)
        return torch.cat([q.reshape(-1).view(torch.uint8), scale.contiguous().view(torch.uint8)])

    def decode(self, data, numel):
        import torch

        n_blocks = numel // self.block
        q = data[:numel].view(torch.int8).reshape(n_blocks, self.block)
        scale = data[numel : numel + 4 * n_blocks].clone().view(torch.float32)
        return (q.to(torch.float32) * scale[:, None]).reshape(-1)


CODECS: dict[str, type[WireCodec]] = {c.name: c for c in (Fp32Codec, Bf16Codec, Int8Codec)}


def get_codec(name: str) -> WireCodec:
    try:
        return CODECS[name]()
    except KeyError:
        raise UserError(f"unknown wire dtype {name!r}; choose one of: {', '.join(CODECS)}") from None


def all_reduce_sum(
    flat: "torch.Tensor",
    codec: WireCodec,
    comm: "CommStats",
    world_size: int,
    comm_device: "torch.device | str" = "cpu",
    group=None,
    local_only: bool = False,
) -> "torch.Tensor":
    """Sum a 1-D fp32 CPU tensor over all ranks, encoded on the wire, accumulated in fp32.

    Returns a new fp32 CPU tensor, bit-identical on every rank. Counts the seconds and the bytes
    this rank sends in `comm`. `group`: the process group (None = the default one, whose
    time-out then bounds every wait). At world size 1 nothing is sent and `flat` comes back as a copy.
    `local_only`: all of this rank's own work (encode, decode, sum) with its own bytes standing in
    for what the peers would send, and nothing on the network - what the plan times to know a
    sync's CPU cost on a node (`diloco.time_step_with_sync`); the result is not a sum over ranks.
    """
    import torch
    import torch.distributed as dist

    if world_size <= 1:
        return flat.clone()
    numel = flat.numel()
    unit = world_size * codec.block
    padded_len = -(-numel // unit) * unit
    padded = torch.zeros(padded_len, dtype=torch.float32)
    padded[:numel] = flat
    chunk = padded_len // world_size
    chunk_bytes = codec.encoded_nbytes(chunk)

    # Phase 1 (reduce-scatter): chunk j of every rank goes to rank j.
    send = torch.cat([codec.encode(c) for c in padded.split(chunk)]).to(comm_device)
    recv = torch.empty_like(send)
    with comm.timed((world_size - 1) * chunk_bytes):
        if local_only:
            recv.copy_(send)
        else:
            dist.all_to_all_single(recv, send, group=group)
    recv = recv.cpu()
    reduced = torch.zeros(chunk, dtype=torch.float32)
    for r in range(world_size):  # fp32 accumulation, rank order: the same on every rank
        reduced += codec.decode(recv[r * chunk_bytes : (r + 1) * chunk_bytes], chunk)

    # Phase 2 (all-gather): every rank's reduced chunk, encoded once, to everyone.
    mine = codec.encode(reduced).to(comm_device)
    gathered = [torch.empty_like(mine) for _ in range(world_size)]
    with comm.timed((world_size - 1) * chunk_bytes):
        if local_only:
            for g in gathered:
                g.copy_(mine)
        else:
            dist.all_gather(gathered, mine, group=group)
    out = torch.cat([codec.decode(g.cpu(), chunk) for g in gathered])
    return out[:numel].clone()
