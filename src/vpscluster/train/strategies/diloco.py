"""DiLoCo: H local steps per rank, then one outer step on the averaged pseudo-gradient.

Douillard et al., "DiLoCo: Distributed Low-Communication Training of Language Models", 2023,
arXiv:2311.08105; streaming variant: Douillard et al., "Streaming DiLoCo with overlapping
communication", 2025, arXiv:2501.18512; int8 pseudo-gradients as in INTELLECT-1 (2024,
arXiv:2412.01152).

Every rank trains its own copy with its own inner optimizer (the loop's AdamW; its state never
leaves the rank). Every H steps:

    Δ_r   = θ_global − θ_r                     (the pseudo-gradient of rank r)
    Δ     = Σ_r (tokens_r / Σ tokens) · Δ_r    (token-weighted: a rank that saw more data counts more)
    m     = μ·m + Δ;  θ_global −= lr·(Δ + μ·m) (SGD with Nesterov momentum, as torch.optim.SGD)
            (with an outer warm-up of W syncs, lr and μ go from (1, 0), plain averaging, at a
            fragment's first sync to (outer_lr, outer_momentum) at its sync W + 1: `outer_settings`)
    θ_r   = θ_global on every rank

All ranks start from identical weights: a sha256 of the weights is compared at set-up, and rank
0's weights are broadcast only when they differ. θ_global and m live in fp32 on the CPU (one flat tensor per fragment). Δ crosses the wire in
fp32, bf16 or int8 (`wire.py`), always summed in fp32.

Streaming: with F fragments (contiguous runs of parameters of about equal size, in model order,
so roughly layer blocks), fragment f is synced at the steps s with s ≡ (f+1)·H/F (mod H): each
fragment still syncs once every H steps, but the traffic is spread over the round instead of
one burst. F = 1 is plain DiLoCo (sync at s ≡ 0 mod H).

Resume: the state holds θ_global, m, and per fragment the outer steps applied (the warm-up's
clock) and the steps and tokens since its last sync,
so a run resumed mid-round continues exactly. `finalize` syncs every fragment with pending
steps so all ranks end on identical weights; because that changes the weights, the state saved
after it is the snapshot from just *before* it (plus this rank's local weights), so resuming a
finished run continues as if it had never stopped.

The loop contract: `tokens_processed(n)` is called for each step before `step(optimizer, step)`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vpscluster.errors import UserError
from vpscluster.train.strategies.base import DistContext, Strategy, ring_allreduce_bytes
from vpscluster.train.strategies.wire import all_reduce_sum, get_codec

if TYPE_CHECKING:
    import torch
    from torch import nn

    from vpscluster.train.config import StrategyConfig

STATE_FORMAT = 1


MAX_FAILED_SYNCS_IN_A_ROW = 3


def split_fragments(sizes: list[int], n_fragments: int) -> list[list[int]]:
    """Cut parameter indices (in model order) into `n_fragments` contiguous, non-empty runs of
    about equal total size. Pure arithmetic so it can be tested without torch."""
    if n_fragments > len(sizes):
        raise UserError(
            f"strategy.fragments ({n_fragments}) exceeds the model's {len(sizes)} parameter tensors; "
            "choose fewer fragments"
        )
    total = sum(sizes)
    out: list[list[int]] = []
    current: list[int] = []
    filled = 0
    for i, size in enumerate(sizes):
        current.append(i)
        filled += size
        remaining_params = len(sizes) - i - 1
        remaining_fragments = n_fragments - len(out) - 1
        # Close a fragment once it reaches its share of the total, but always leave at least one
        # parameter for each fragment still to come.
        if remaining_fragments > 0 and (
            filled >= total * (len(out) + 1) / n_fragments or remaining_params == remaining_fragments
        ):
            out.append(current)
            current = []
    out.append(current)
    return out


def outer_settings(outer_lr: float, outer_momentum: float, warmup: int, done: int) -> tuple[float, float]:
    """The outer (lr, momentum) of a fragment's sync after `done` earlier ones, with a warm-up of
    `warmup` syncs: from plain averaging (lr 1, no momentum) at the first sync, linearly to
    (outer_lr, outer_momentum) at sync `warmup` + 1. warmup 0: (outer_lr, outer_momentum) always.

    Why: trained from scratch, the first pseudo-gradient is the huge move away from the random
    start. Nesterov at m = 0 applies lr·(1 + μ)·Δ (1.12·Δ at 0.7 / 0.9: past the average), and
    the momentum then replays 0.9·Δ₁ at the next syncs, which by then point elsewhere; both raised
    the validation loss right after the first outer steps (issue 16). Averaging first, then
    letting lr·(1 + μ) grow from 1 to DiLoCo's 1.33 while Δ shrinks to its steady size, removed
    the rise (tiny, 2 local ranks, H = 50: validation 2.499 before the first sync, 2.530 after
    it without the warm-up, 2.461 with it; 2.410 → 2.516 and 2.407 → 2.409 at the second).
    Pure in its arguments, so every rank (and a resumed run) computes the same values.
    """
    if warmup <= 0:
        return outer_lr, outer_momentum
    w = min(1.0, done / warmup)
    return 1.0 + (outer_lr - 1.0) * w, outer_momentum * w


def sync_offset(fragment: int, n_fragments: int, sync_every: int) -> int:
    """Fragment f syncs at steps s with s % H == this offset (0 for the last fragment)."""
    return ((fragment + 1) * sync_every // n_fragments) % sync_every


class DiLoCoStrategy(Strategy):
    name = "diloco"
    micro_batches_are_steps = True  # uneven shares: a faster rank does more inner steps per round

    def __init__(self, config: "StrategyConfig", ctx: DistContext) -> None:
        super().__init__(config, ctx)
        self.codec = get_codec(config.wire_dtype)
        self.model: "nn.Module | None" = None
        self.fragment_params: list[list["torch.Tensor"]] = []
        self.global_flat: list["torch.Tensor"] = []  # fp32, CPU
        self.momentum: list["torch.Tensor"] = []  # fp32, CPU
        self.steps_since_sync: list[int] = []
        self.tokens_since_sync: list[float] = []
        self.outer_steps = 0  # fragment syncs done on this rank (all fragments together)
        self.fragment_syncs: list[int] = []  # outer steps applied per fragment (the outer warm-up's clock)
        # Outer syncs: started, retried (attempts beyond the first), failed (skipped after retries).
        self.syncs_attempted = 0
        self.syncs_retried = 0
        self.syncs_failed = 0
        self._failed_in_a_row = 0
        self.sync_group = None  # the syncs' own process group when sync_timeout_s is set (else ctx.group)
        self._pre_finalize_state: dict[str, Any] | None = None
        # gloo moves CPU tensors, NCCL device tensors.
        self.comm_device = ctx.device if ctx.backend == "nccl" else "cpu"

    # -- set-up -------------------------------------------------------------------------------

    def setup(self, model: "nn.Module") -> "nn.Module":
        import torch
        import torch.distributed as dist

        self.model = model
        params = [p for p in model.parameters() if p.requires_grad]
        groups = split_fragments([p.numel() for p in params], self.config.fragments)
        self.fragment_params = [[params[i] for i in g] for g in groups]
        flats = [self._local_flat(f) for f in range(len(groups))]
        if self.ctx.is_distributed and not self._identical_everywhere(flats):
            # All ranks start from rank 0's weights, whatever their seeds did. Usually the model
            # is built from one seed and the hash check above saved sending it (43 MB for `small`).
            for f, flat in enumerate(flats):
                buf = flat.to(self.comm_device)
                sent = flat.numel() * 4 * (self.ctx.world_size - 1) if self.ctx.rank == 0 else 0
                with self.comm.timed(sent):
                    dist.broadcast(buf, src=0)  # start-up: the default group, long time-out
                flats[f] = buf.cpu()
                self._write_local(f, flats[f])
        if self.ctx.is_distributed and self.config.sync_timeout_s > 0:
            self.sync_group = self._new_sync_group()
        for flat in flats:
            self.global_flat.append(flat.clone())
            self.momentum.append(torch.zeros_like(flat))
        self.steps_since_sync = [0] * len(groups)
        self.tokens_since_sync = [0.0] * len(groups)
        self.fragment_syncs = [0] * len(groups)
        return model

    def _identical_everywhere(self, flats: list["torch.Tensor"]) -> bool:
        """Do all ranks hold bit-identical weights? One sha256 per rank is exchanged."""
        import hashlib

        import torch.distributed as dist

        h = hashlib.sha256()
        for flat in flats:
            h.update(flat.numpy().tobytes())
        digests: list = [None] * self.ctx.world_size
        # all_gather_object: a size tensor, then the pickled 64-character digest, to every peer.
        with self.comm.timed((self.ctx.world_size - 1) * (8 + 96)):
            dist.all_gather_object(digests, h.hexdigest())
        return len(set(digests)) == 1

    def _local_flat(self, f: int) -> "torch.Tensor":
        import torch

        return torch.cat([p.detach().to("cpu", torch.float32).reshape(-1) for p in self.fragment_params[f]])

    def _write_local(self, f: int, flat: "torch.Tensor") -> None:
        import torch

        offset = 0
        with torch.no_grad():
            for p in self.fragment_params[f]:
                n = p.numel()
                p.copy_(flat[offset : offset + n].view_as(p).to(p.device, p.dtype))
                offset += n

    # -- the loop's calls -----------------------------------------------------------------------

    def tokens_processed(self, tokens: int) -> None:
        for f in range(len(self.tokens_since_sync)):
            self.tokens_since_sync[f] += tokens

    def step(self, optimizer: "torch.optim.Optimizer", step: int) -> None:
        optimizer.step()
        H, F = self.config.sync_every, len(self.fragment_params)
        for f in range(F):
            self.steps_since_sync[f] += 1
            if step % H == sync_offset(f, F, H):
                self._sync(f)

    def finalize(self, step: int) -> None:
        pending = [f for f, n in enumerate(self.steps_since_sync) if n > 0]
        if not pending:
            return
        self._pre_finalize_state = self._state(include_local=True)
        for f in pending:
            self._sync(f)

    # -- the outer step -------------------------------------------------------------------------

    def _new_sync_group(self, short: bool = True):
        """A fresh process group for the outer syncs (collective: every rank calls it alike).

        `short`: with the sync time-out (all ranks are in step, e.g. right after a sync). A retry
        uses the run's default time-out instead: it must wait for a rank that is late (frozen,
        its link down) to come back, which is the point of retrying.
        """
        from datetime import timedelta

        import torch.distributed as dist

        if short and self.config.sync_timeout_s > 0:
            return dist.new_group(timeout=timedelta(seconds=self.config.sync_timeout_s))
        return dist.new_group()

    def _reduce(self, f: int, delta: "torch.Tensor", group) -> "torch.Tensor":
        """The token-weighted sum of every rank's `delta` (two collectives on `group`)."""
        import torch
        import torch.distributed as dist

        tokens = torch.tensor([self.tokens_since_sync[f]], dtype=torch.float64, device=self.comm_device)
        with self.comm.timed(ring_allreduce_bytes(8, self.ctx.world_size)):
            dist.all_reduce(tokens, group=group)
        total = float(tokens.item())
        # No token counts reported at all: weigh ranks equally.
        weight = self.tokens_since_sync[f] / total if total > 0 else 1.0 / self.ctx.world_size
        return all_reduce_sum(delta * weight, self.codec, self.comm, self.ctx.world_size, self.comm_device, group)

    def _reduce_with_retry(self, f: int, delta: "torch.Tensor") -> "torch.Tensor | None":
        """`_reduce`, retried on a fresh group after a time-out or a broken link; None when every
        attempt failed (the round is skipped: nothing is applied, the next sync carries its delta).

        Every rank sees a collective fail alike in practice (a peer that is late or gone stalls
        them all), so all retry together; `sync_retries` + 1 attempts, and after
        MAX_FAILED_SYNCS_IN_A_ROW skipped rounds in a row the run stops: the peer is gone.
        """
        import sys

        self.syncs_attempted += 1
        group = self.sync_group if self.sync_group is not None else self.ctx.group
        for attempt in range(self.config.sync_retries + 1):
            try:
                if attempt:
                    self.syncs_retried += 1
                    group = self._new_sync_group(short=False)  # waits for a late rank (default time-out)
                reduced = self._reduce(f, delta, group)
                if attempt:  # every rank is here together now: back to a group with the short time-out
                    self.sync_group = self._new_sync_group() if self.config.sync_timeout_s > 0 else group
                self._failed_in_a_row = 0
                return reduced
            except RuntimeError as e:  # gloo/NCCL time-outs, closed connections, store time-outs (DistError)
                why = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
                print(f"warning: outer sync {self.syncs_attempted} attempt {attempt + 1} failed on rank "
                      f"{self.ctx.rank}: {why}", file=sys.stderr, flush=True)
        self.syncs_failed += 1
        self._failed_in_a_row += 1
        if self._failed_in_a_row >= MAX_FAILED_SYNCS_IN_A_ROW:
            raise RuntimeError(f"{self._failed_in_a_row} outer syncs in a row failed after "
                               f"{self.config.sync_retries} retries each: a peer is gone")
        return None

    def _sync(self, f: int) -> None:
        local = self._local_flat(f)
        delta = self.global_flat[f] - local
        if self.ctx.is_distributed:
            delta = self._reduce_with_retry(f, delta)
            if delta is None:  # skipped: keep training locally; the next sync carries this round too
                return
        self._outer_update(f, delta)
        self._write_local(f, self.global_flat[f])
        self.steps_since_sync[f] = 0
        self.tokens_since_sync[f] = 0.0
        self.outer_steps += 1

    def _outer_update(self, f: int, delta: "torch.Tensor") -> None:
        """θ_global −= lr·(Δ + μ·m) after m = μ·m + Δ, at the warm-up's lr and μ for this sync."""
        lr, mu = outer_settings(self.config.outer_lr, self.config.outer_momentum, self.config.outer_warmup,
                                self.fragment_syncs[f])
        m = self.momentum[f]
        m.mul_(mu).add_(delta)
        update = delta.add(m, alpha=mu) if mu > 0 else delta  # Nesterov, as torch.optim.SGD
        self.global_flat[f].sub_(update, alpha=lr)
        self.fragment_syncs[f] += 1

    # -- what the loop reads --------------------------------------------------------------------

    def unwrap(self) -> "nn.Module":
        if self.model is None:
            raise RuntimeError("DiLoCoStrategy.unwrap before setup")
        return self.model

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "sync_every": self.config.sync_every,
            "outer_lr": self.config.outer_lr,
            "outer_momentum": self.config.outer_momentum,
            "outer_warmup": self.config.outer_warmup,
            "wire_dtype": self.codec.name,
            "fragments": self.config.fragments,
            "outer_syncs": self.outer_steps,
            "sync_timeout_s": self.config.sync_timeout_s or None,
            "sync_retries": self.config.sync_retries,
            "syncs_attempted": self.syncs_attempted,
            "syncs_retried": self.syncs_retried,
            "syncs_failed": self.syncs_failed,
            "sync_failure_rate": self.syncs_failed / self.syncs_attempted if self.syncs_attempted else 0.0,
        }

    # -- checkpoints ----------------------------------------------------------------------------

    def _state(self, include_local: bool) -> dict[str, Any]:
        state: dict[str, Any] = {
            "format": STATE_FORMAT,
            "fragment_numels": [int(g.numel()) for g in self.global_flat],
            "global": [g.clone() for g in self.global_flat],
            "momentum": [m.clone() for m in self.momentum],
            "steps_since_sync": list(self.steps_since_sync),
            "tokens_since_sync": list(self.tokens_since_sync),
            "outer_steps": self.outer_steps,
            "fragment_syncs": list(self.fragment_syncs),
        }
        if include_local:
            state["local"] = [self._local_flat(f) for f in range(len(self.fragment_params))]
        return state

    def state_dict(self) -> dict[str, Any]:
        if self._pre_finalize_state is not None:
            return self._pre_finalize_state
        return self._state(include_local=False)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore after `setup`. When the state carries local weights (saved by `finalize`),
        they replace the model's, so call this after the model's own weights are loaded."""
        if state.get("format") != STATE_FORMAT:
            raise UserError(f"checkpoint: DiLoCo state format {state.get('format')!r} is not {STATE_FORMAT}; "
                            "it was written by another vpscluster version, start a new run")
        numels = [int(g.numel()) for g in self.global_flat]
        if list(state["fragment_numels"]) != numels:
            raise UserError(
                f"checkpoint: DiLoCo fragments {state['fragment_numels']} do not match this model's {numels}; "
                "resume with the same preset and --fragments as the checkpointed run"
            )
        self.global_flat = [g.to("cpu", copy=True) for g in state["global"]]
        self.momentum = [m.to("cpu", copy=True) for m in state["momentum"]]
        self.steps_since_sync = [int(n) for n in state["steps_since_sync"]]
        self.tokens_since_sync = [float(n) for n in state["tokens_since_sync"]]
        self.outer_steps = int(state["outer_steps"])
        # Older checkpoints kept no per-fragment count: every fragment synced alike, up to one.
        self.fragment_syncs = [int(n) for n in state.get("fragment_syncs")
                               or [self.outer_steps // len(numels)] * len(numels)]
        for f, flat in enumerate(state.get("local") or []):
            self._write_local(f, flat)
