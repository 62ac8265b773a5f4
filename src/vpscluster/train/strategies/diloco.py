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
fp32, bf16 or int8 (`wire.py`), always summed in fp32; or sparse (`sparse_wire.py`: the top-k of
each chunk in 2 or 4 bits, all-gathered, with a per-rank error-feedback residual e that is added
to the next Δ_r and checkpointed with the state).

Streaming: with F fragments (contiguous runs of parameters of about equal size, in model order,
so roughly layer blocks), fragment f is synced at the steps s with s ≡ (f+1)·H/F (mod H): each
fragment still syncs once every H steps, but the traffic is spread over the round instead of
one burst. F = 1 is plain DiLoCo (sync at s ≡ 0 mod H).

Overlap (Streaming DiLoCo's overlapping communication, arXiv:2501.18512): with
τ = `overlap_steps` > 0, at fragment f's sync step s the rank computes Δ_r from its weights at s,
hands the reduction (token all-reduce + pseudo-gradient all-reduce, any wire codec) to a
background thread that uses the syncs' own process group, and keeps taking inner steps. At step
s + τ it waits for the result (the only time it may block on the network), applies the outer
update to θ_global (`_outer_update`, the same function as without overlap) and merges the local
progress made meanwhile:

    θ_r ← θ_global_new + (θ_r(s+τ) − θ_r(s))       (the delta merge)

so no inner step is thrown away (the paper's alternative, mixing θ_r and θ_global with a
factor α, is not implemented). θ_global after the k-th sync is bit-identical on every rank.
With inner updates that do not depend on the weights the pseudo-gradients, and so every
θ_global, are exactly those of the blocking run: only the moment they land moves, τ steps
later (tests/test_diloco_overlap.py checks this). τ is capped at H − 1, so a fragment is never
sent again before its update has landed. τ = 0 is the blocking sync, run on the loop's thread.

Agreement: a sync attempt can fail on one rank and succeed on another (a collective that
completes on rank 0 while rank 1's time-out fires), so no rank decides alone. After every attempt
the ranks all-reduce a success flag (MIN, on a group of their own with the loop's time-out,
`_agree`): the outer update is applied only where the attempt succeeded on every rank; otherwise
every rank retries on a fresh group, or skips the round and keeps its pre-sync state, alike. An
agreement that fails itself stops the run. The trainer compares `replica_sha256` (θ_global, m,
the outer steps) across ranks before every checkpoint (`Session.check_replicas`).

Resume: the state holds θ_global, m, and per fragment the outer steps applied (the warm-up's
clock) and the steps and tokens since its last sync,
so a run resumed mid-round continues exactly. With overlap, `state_dict` does not wait for the
syncs in flight: it saves each one's fragment, the step it lands, θ_r(s) and either the reduced
Δ (done) or this rank's Δ_r, which the resumed run reduces again (every rank resumes from the
same step, and the reduction is deterministic), so the update lands at the same step with the
same value. `finalize` applies those in flight, then syncs every fragment with pending
steps so all ranks end on identical weights; because that changes the weights, the state saved
after it is the snapshot from just *before* it (plus this rank's local weights), so resuming a
finished run continues as if it had never stopped.

Inner learning rate: `lr` is the peak lr for the global batch, as for ddp, but each replica's
AdamW steps on 1/M of it (M = the micro-batches of a global step, one per rank by default). Its
lr is scaled by 1/sqrt(M) (`inner_lr_scale`; the learning-rate part of the square-root scaling
rule for Adam, Malladi et al., 2022, arXiv:2205.10287, which also adjusts the betas and epsilon;
those stay as set), or by `strategy.inner_lr_scale` when set. On `small`
with 4 replicas, DiLoCo at lr/2 learned about as much per step as ddp at lr; at lr it fell
behind (BENCHMARKS.md, "wan").

The loop contract: `tokens_processed(n)` is called for each step before `step(optimizer, step)`.
"""

from __future__ import annotations

import contextlib
import math
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator

from vpscluster.errors import UserError
from vpscluster.train.config import StrategyConfig
from vpscluster.train.strategies.base import CommStats, DistContext, Strategy, ring_allreduce_bytes
from vpscluster.train.strategies.wire import all_reduce_sum
from vpscluster.train.strategies import sparse_wire

if TYPE_CHECKING:
    import torch
    from torch import nn

STATE_FORMAT = 1


MAX_FAILED_SYNCS_IN_A_ROW = 3
# The settings `retune` may change mid-run: the sync rule's (`train/strategies/sync_rule.py: KEYS`).
RETUNABLE = ("sync_every", "wire_dtype", "outer_lr", "outer_momentum", "outer_warmup")


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


def inner_lr_scale(configured: float, global_micro: int) -> float:
    """The factor on the schedule's lr for a replica's inner optimizer: `configured` when set
    (> 0), else 1/sqrt(M) for M micro-batches per global step (M <= 1: 1)."""
    if configured > 0:
        return configured
    return 1.0 / math.sqrt(max(1, global_micro))


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


SYNC_HASH = re.compile(r"diloco sync: fragment (\d+) outer step (\d+) at step (\d+) world (\d+) sha256 ([0-9a-f]{64})")


def tensor_sha256(t: "torch.Tensor") -> str:
    import hashlib

    return hashlib.sha256(t.contiguous().numpy().tobytes()).hexdigest()


def sync_hash_line(fragment: int, outer_step: int, step: int, world_size: int, digest: str) -> str:
    """The line `strategy.sync_hashes` logs on every rank after an outer update (SYNC_HASH parses it)."""
    return f"diloco sync: fragment {fragment} outer step {outer_step} at step {step} world {world_size} sha256 {digest}"


def parse_sync_hash(line: str) -> dict[str, Any] | None:
    m = SYNC_HASH.search(line)
    if not m:
        return None
    f, n, step, world, digest = m.groups()
    return {"fragment": int(f), "outer_step": int(n), "step": int(step), "world_size": int(world), "sha256": digest}


def sync_offset(fragment: int, n_fragments: int, sync_every: int) -> int:
    """Fragment f syncs at steps s with s % H == this offset (0 for the last fragment)."""
    return ((fragment + 1) * sync_every // n_fragments) % sync_every


def time_step_with_sync(model: "nn.Module", train_step, wire_dtype: str, world_size: int) -> float:
    """Wall seconds of one training step with a whole-model outer sync in flight, the network
    left out, as an overlapped DiLoCo round runs it on one rank: the send (flat copy,
    pseudo-gradient), `train_step()` while the reduction's encode, decode and fp32 sums run on a
    background thread (`all_reduce_sum(local_only=True)`, the chunks of `world_size` ranks), then
    the landing (progress, outer Nesterov step, write-back) - this strategy's own methods on one
    fragment. Training counts all of it as compute, and on a node with a small CPU quota the
    sync's work shares the quota with the step: minus a plain step, it is what a sync adds to a
    round (`plan.steptime` measures it; `plan.predict` spreads it over H steps). Changes `model`."""
    import time
    from concurrent.futures import ThreadPoolExecutor

    s = DiLoCoStrategy(StrategyConfig(name="diloco", wire_dtype=wire_dtype, outer_warmup=0), DistContext())
    s.setup(model)
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="diloco-sync") as pool:
        t0 = time.perf_counter()
        at_send = s._local_flat(0)  # _send
        delta = s.global_flat[0] - at_send
        future = pool.submit(all_reduce_sum, delta * (1.0 / world_size), s.codec, CommStats(), world_size,
                             local_only=True)
        train_step()
        reduced = future.result()
        progress = s._local_flat(0) - at_send  # _land
        s._outer_update(0, reduced)
        s._write_local(0, s.global_flat[0] + progress)
        return time.perf_counter() - t0


@dataclass
class _InFlight:
    """A fragment's overlapped sync: sent at step `apply_at` − τ, lands at `apply_at`."""

    fragment: int
    apply_at: int
    at_send: "torch.Tensor"  # θ_r of the fragment when Δ_r was taken
    steps: int  # inner steps and tokens the round covered (given back if the sync is skipped)
    tokens: float
    future: Any = None  # the background reduction; None once waited for
    result: "torch.Tensor | None" = None  # the reduced Δ; None (once waited for) = skipped
    sent: "torch.Tensor | None" = None  # this rank's Δ_r, kept until the reduction is done


class DiLoCoStrategy(Strategy):
    name = "diloco"

    def __init__(self, config: "StrategyConfig", ctx: DistContext) -> None:
        super().__init__(config, ctx)
        # τ: outer updates land this many inner steps after their send (0 = blocking).
        self.overlap = min(config.overlap_steps, config.sync_every - 1) if ctx.is_distributed else 0
        self.in_flight: list[_InFlight] = []  # oldest first
        self._executor = None  # the one background thread that runs overlapped reductions
        self._closed = False
        self._bg_comm = CommStats()  # its bytes (and busy seconds), moved to `comm` when waited for
        self.collective_busy_seconds = 0.0  # seconds the background reductions ran
        self.codec = sparse_wire.wire_codec(config.wire_dtype)
        self.ef: sparse_wire.ErrorFeedback | None = None  # sparse wires: this rank's residuals (`sparse_wire.py`)
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
        # Where the ranks agree on each sync attempt's outcome (`_agree`): a group of its own, so a
        # sync group that a time-out broke cannot break the agreement, and the overlapped syncs'
        # thread never shares a group with the loop's collectives.
        self.agree_group = None
        self.syncs_disagreed = 0  # attempts that failed on some ranks while others succeeded
        self._pre_finalize_state: dict[str, Any] | None = None
        self.retuned: dict[str, Any] | None = None  # the settings `retune` switched to, if any
        self._step = 0  # the loop's step, for the sync hash lines
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
        if self.ctx.is_distributed:
            self.agree_group = dist.new_group()  # time-out: the loop's (`collective_groups`)
        if self.ctx.is_distributed and (self.config.sync_timeout_s > 0 or self.overlap > 0):
            # Overlapped syncs run on a background thread: they need a group of their own, the
            # loop keeps using the default one (time-budget agreement, checkpoints) meanwhile.
            self.sync_group = self._new_sync_group()
        for flat in flats:
            self.global_flat.append(flat.clone())
            self.momentum.append(torch.zeros_like(flat))
        self.steps_since_sync = [0] * len(groups)
        self.tokens_since_sync = [0.0] * len(groups)
        self.fragment_syncs = [0] * len(groups)
        self._sparse_setup()
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

    @property
    def replicas(self) -> int:
        """The models that train apart and meet at an outer sync: one per rank here (a
        hierarchical run has one per region, `hierarchical.py`)."""
        return self.ctx.world_size

    def round_length(self) -> int:
        """Inner steps between two syncs of a fragment: H."""
        return self.config.sync_every

    def step(self, optimizer: "torch.optim.Optimizer", step: int) -> None:
        optimizer.step()
        self._after_inner_step(step)

    def _after_inner_step(self, step: int) -> None:
        """Count the step; land the overlapped syncs due; sync the fragments this step schedules."""
        self._step = step
        H, F = self.round_length(), len(self.fragment_params)
        for f in range(F):
            self.steps_since_sync[f] += 1
        while self.in_flight and self.in_flight[0].apply_at <= step:  # updates sent τ steps ago land
            self._land(self.in_flight.pop(0))
        for f in range(F):
            if step % H == sync_offset(f, F, H):
                if self.overlap:
                    self._send(f, step)
                else:
                    self._sync(f)

    def lr_scale(self) -> float:
        """The replicas' inner lr factor: M = the micro-batches of a global step (one per rank)."""
        return inner_lr_scale(self.config.inner_lr_scale, self.config.micro_batches or self.replicas)

    def is_sync_point(self, step: int) -> bool:
        """The steps an outer update lands (sent τ steps earlier): the ranks wait there anyway."""
        H, F = self.round_length(), len(self.fragment_params)
        sent = step - self.overlap
        return sent >= 1 and any(sent % H == sync_offset(f, F, H) for f in range(F))

    def eval_point(self, step: int) -> bool:
        """Validation runs where an outer update lands (the ranks wait for each other there
        anyway): a validation due mid-round waits for the next landing."""
        return not self.ctx.is_distributed or self.is_sync_point(step)

    @contextlib.contextmanager
    def eval_weights(self) -> "Iterator[nn.Module]":
        """The global weights θ_global in the model for the block, the replica's own weights
        written back after. θ_global is the model DiLoCo produces (the last outer step's; the
        run's final weights) and the same on every rank, so every rank validates a share of the
        batches, as ddp does. (Rank 0 validating its own replica alone, as before, measured one
        replica mid-round and, every few steps, held the other ranks at the next sync: 126 s of
        900 in `bench wan --long`, booked as their communication.)"""
        local = [self._local_flat(f) for f in range(len(self.fragment_params))]
        for f, flat in enumerate(self.global_flat):
            self._write_local(f, flat)
        try:
            yield self.unwrap()
        finally:
            for f, flat in enumerate(local):
                self._write_local(f, flat)

    def finalize(self, step: int) -> None:
        self._step = step
        self._wait_all()
        pending = [f for f, n in enumerate(self.steps_since_sync) if n > 0]
        if not pending and not self.in_flight:
            return
        self._pre_finalize_state = self._state(include_local=True)
        landed = set()
        while self.in_flight:
            entry = self.in_flight.pop(0)
            self._land(entry)
            landed.add(entry.fragment)
        pending = [f for f, n in enumerate(self.steps_since_sync) if n > 0]  # a skipped sync gave its steps back
        for f in pending:
            self._sync(f)
        for f in landed - set(pending):  # sent at the very last step: nothing to merge, θ_r = θ_global
            self._write_local(f, self.global_flat[f])

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

    def _reduce(self, my_tokens: float, delta: "torch.Tensor", group, comm: CommStats) -> "torch.Tensor":
        """The token-weighted sum of every replica's `delta` (two collectives on `group`, of
        `replicas` members)."""
        import torch
        import torch.distributed as dist

        world = self.participants()
        if isinstance(self.codec, sparse_wire.SparseCodec):  # one all-gather; the tokens ride in it
            return sparse_wire.all_gather_sum(delta, my_tokens, self.codec, comm, world, self.comm_device, group)
        tokens = torch.tensor([my_tokens], dtype=torch.float64, device=self.comm_device)
        with comm.timed(ring_allreduce_bytes(8, world)):
            dist.all_reduce(tokens, group=group)
        total = float(tokens.item())
        # No token counts reported at all: weigh ranks equally.
        weight = my_tokens / total if total > 0 else 1.0 / world
        return all_reduce_sum(delta * weight, self.codec, comm, world, self.comm_device, group)

    def participants(self) -> int:
        """The replicas an outer sync reduces over: `replicas` (the quorum engine: the replica
        groups of the current quorum)."""
        return self.replicas

    def collective_groups(self) -> list:
        """The agreement group: it waits as long as the loop's own collectives (the trainer sets
        its time-out with the default group's, `session/dist.py: end_startup`)."""
        return [self.agree_group] if self.agree_group is not None else []

    def _agree(self, ok: bool, comm: CommStats) -> bool:
        """Did the attempt succeed on every rank? A MIN all-reduce of a one-integer flag on
        `agree_group`. A rank cannot tell alone: a collective can complete on one rank and time
        out on its peer (the last chunk arrived just as the peer gave up), and a rank that then
        applied the update while its peer skipped it would leave the replicas different for the
        rest of the run. An agreement that fails itself (a peer gone for longer than the loop's
        time-out) raises: no rank can know what the others did, so the run stops and resumes
        from its last checkpoint, whose replicas were compared (`Session.save`)."""
        import torch
        import torch.distributed as dist

        flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=self.comm_device)
        with comm.timed(ring_allreduce_bytes(4, self.ctx.world_size)):
            dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.agree_group)
        agreed = bool(flag.item())
        if ok and not agreed:
            self.syncs_disagreed += 1
        return agreed

    def _reduce_with_retry(self, my_tokens: float, delta: "torch.Tensor", comm: CommStats | None = None) -> "torch.Tensor | None":
        """`_reduce`, retried on a fresh group after a time-out or a broken link; None when every
        attempt failed (the round is skipped: nothing is applied, the next sync carries its delta).

        After each attempt the ranks agree on its outcome (`_agree`): the update is applied only
        where it succeeded on every rank, so a rank whose collective completed while a peer's
        failed retries (or skips the round) with that peer, and the replicas stay identical.
        `sync_retries` + 1 attempts, and after MAX_FAILED_SYNCS_IN_A_ROW skipped rounds in a row
        the run stops (on every rank alike): the peer is gone.
        """
        import sys

        comm = comm or self.comm
        self.syncs_attempted += 1
        group = self.sync_group if self.sync_group is not None else self.ctx.group
        # gloo closes the pairs of a collective that timed out: after a skipped round the group
        # that failed is spent, and this sync starts on a fresh one (as a retry does).
        fresh = self._failed_in_a_row > 0
        for attempt in range(self.config.sync_retries + 1):
            if (attempt or fresh) and self._closed:  # closed meanwhile: the peers will not join a new group
                break
            reduced = None
            try:
                if attempt:
                    self.syncs_retried += 1
                if attempt or fresh:
                    group = self._new_sync_group(short=False)  # waits for a late rank (default time-out)
                reduced = self._reduce(my_tokens, delta, group, comm)
            except RuntimeError as e:  # gloo/NCCL time-outs, closed connections, store time-outs (DistError)
                why = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
                print(f"warning: outer sync {self.syncs_attempted} attempt {attempt + 1} failed on rank "
                      f"{self.ctx.rank}: {why}", file=sys.stderr, flush=True)
            ok = reduced is not None
            if self.agree_group is not None:
                ok = self._agree(ok, comm)
            if not ok:
                if reduced is not None:
                    print(f"warning: outer sync {self.syncs_attempted} attempt {attempt + 1} failed on another "
                          f"rank: rank {self.ctx.rank} does not apply it either", file=sys.stderr, flush=True)
                fresh = True  # the group is spent on some rank: every rank goes on with a fresh one
                continue
            if attempt or fresh:  # every rank is here together now: back to a group with the short time-out
                self.sync_group = self._new_sync_group() if self.config.sync_timeout_s > 0 else group
            self._failed_in_a_row = 0
            return reduced
        self.syncs_failed += 1
        self._failed_in_a_row += 1
        if self._failed_in_a_row >= MAX_FAILED_SYNCS_IN_A_ROW:
            raise RuntimeError(f"{self._failed_in_a_row} outer syncs in a row failed after "
                               f"{self.config.sync_retries} retries each: a peer is gone")
        return None

    def _sync(self, f: int) -> None:
        """The blocking sync of fragment f (τ = 0, and `finalize`)."""
        local = self._local_flat(f)
        delta = self.global_flat[f] - local
        if self.ctx.is_distributed:
            delta = self._reduce_with_retry(self.tokens_since_sync[f], self._to_send(f, delta))
            self._sparse_done(f, delta is not None)
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
        if self.config.sync_hashes:
            print(sync_hash_line(f, self.fragment_syncs[f], self._step, self.participants(),
                                 tensor_sha256(self.global_flat[f])), flush=True)

    def _send(self, f: int, step: int) -> None:
        """Start fragment f's overlapped sync: its reduction runs on the background thread."""
        local = self._local_flat(f)
        delta = self.global_flat[f] - local
        entry = _InFlight(f, step + self.overlap, local, self.steps_since_sync[f], self.tokens_since_sync[f],
                          sent=self._to_send(f, delta))
        self._submit(entry)
        self.in_flight.append(entry)
        self.steps_since_sync[f] = 0  # the next round counts from here
        self.tokens_since_sync[f] = 0.0

    def _submit(self, entry: _InFlight) -> None:
        from concurrent.futures import ThreadPoolExecutor

        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="diloco-sync")
        # One thread, so reductions run (and their collectives are issued) in send order on every rank.
        entry.future = self._executor.submit(self._reduce_with_retry, entry.tokens, entry.sent, self._bg_comm)

    def _wait(self, entry: _InFlight) -> None:
        """Block until the entry's reduction is done (counted as communication: this rank waits)."""
        import time

        if entry.future is None:
            return
        t0 = time.perf_counter()
        try:
            entry.result = entry.future.result()
        finally:
            entry.future = entry.sent = None
            busy, nbytes = self._bg_comm.take()
            self.collective_busy_seconds += busy
            self.comm.add(time.perf_counter() - t0, nbytes)

    def _wait_all(self) -> None:
        for entry in self.in_flight:
            self._wait(entry)

    def _land(self, entry: _InFlight) -> None:
        """Apply an overlapped sync τ steps after its send, keeping the local progress since."""
        self._wait(entry)
        f = entry.fragment
        self._sparse_done(f, entry.result is not None)
        if entry.result is None:  # skipped: the next sync carries this round too
            self.steps_since_sync[f] += entry.steps
            self.tokens_since_sync[f] += entry.tokens
            return
        progress = self._local_flat(f) - entry.at_send
        self._outer_update(f, entry.result)
        self._write_local(f, self.global_flat[f] + progress)
        self.outer_steps += 1

    # -- settings changed mid-run ----------------------------------------------------------------

    def retune(self, settings: dict[str, Any]) -> None:
        """Switch to other sync settings (`RETUNABLE`) from the next step on; every rank calls it
        at the same step with the same settings (`train/replan.py`). The syncs in flight are
        waited for first (their reductions use the old wire), then land as scheduled; the next
        sync comes at the next step that the new H schedules. The settings go into checkpoints."""
        unknown = set(settings) - set(RETUNABLE)
        if unknown:
            raise ValueError(f"DiLoCo cannot retune {', '.join(sorted(unknown))} mid-run")
        self._wait_all()
        for key, value in settings.items():
            setattr(self.config, key, value)
        self.config.validate()
        self.codec = sparse_wire.wire_codec(self.config.wire_dtype)
        self._sparse_setup()
        overlap = min(self.config.overlap_steps, self.config.sync_every - 1) if self.ctx.is_distributed else 0
        if overlap > 0 and self.sync_group is None:
            self.sync_group = self._new_sync_group()  # collective: every rank is here at the same step
        self.overlap = overlap
        self.retuned = {k: getattr(self.config, k) for k in RETUNABLE}

    # -- what the loop reads --------------------------------------------------------------------

    def close(self) -> None:
        self._closed = True  # an abandoned reduction must not retry: that makes groups, a collective
        if self._executor is not None:  # a reduction still running (the run failed) is abandoned
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None

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
            "inner_lr_scale": self.lr_scale(),
            "wire_dtype": self.codec.name,
            "fragments": self.config.fragments,
            "overlap_steps": self.overlap,
            "outer_syncs": self.outer_steps,
            "collective_busy_seconds": self.collective_busy_seconds if self.overlap else None,
            "sync_timeout_s": self.config.sync_timeout_s or None,
            "sync_retries": self.config.sync_retries,
            "syncs_attempted": self.syncs_attempted,
            "syncs_retried": self.syncs_retried,
            "syncs_failed": self.syncs_failed,
            "sync_failure_rate": self.syncs_failed / self.syncs_attempted if self.syncs_attempted else 0.0,
            "syncs_disagreed": self.syncs_disagreed,
        }

    def replica_sha256(self) -> str:
        """θ_global, the outer momentum and the outer steps per fragment: the same on every rank
        after every sync (the local weights θ_r are not: every replica trains its own)."""
        from vpscluster.train.checkpoint import state_hash

        return state_hash({"global": self.global_flat, "momentum": self.momentum, "fragment_syncs": self.fragment_syncs})

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
            "retuned": dict(self.retuned) if self.retuned else None,  # settings re-planned mid-run
            "sparse_ef": self.ef.state_dict() if self.ef is not None else None,  # this rank's residuals
            # Overlapped syncs in flight: the reduced Δ when done, else this rank's Δ_r, which a
            # resumed run reduces again (every rank resumes from the same step: same collectives).
            "in_flight": [
                {"fragment": e.fragment, "apply_at": e.apply_at, "at_send": e.at_send.clone(), "steps": e.steps,
                 "tokens": e.tokens, "result": None if e.result is None else e.result.clone(),
                 "sent": None if e.sent is None else e.sent.clone()}
                for e in self.in_flight
            ],
        }
        if include_local:
            state["local"] = [self._local_flat(f) for f in range(len(self.fragment_params))]
        return state

    def state_dict(self) -> dict[str, Any]:
        """The state to checkpoint. A reduction still in flight is saved as sent (its delta), not
        waited for, and is run again on resume (same inputs, same sum) — also when it happens to
        be done here already: ranks finish a collective at slightly different moments, and a rank
        that saved the result while its peer saved the delta would resume waiting on a reduction
        the peer never runs again. Every rank saves the same thing at the same step."""
        if self._pre_finalize_state is not None:
            return self._pre_finalize_state
        return self._state(include_local=False)

    def reshard_state(self, state: dict[str, Any]) -> dict[str, Any]:
        """A checkpoint of another world: the global weights and outer momentum are everyone's;
        this rank's local weights and its steps since the last sync stay, and the next sync
        reduces over the ranks present (weighted by tokens, as always). A reduction that was in
        flight cannot be finished without the old ranks: it counts as skipped, so its steps and
        tokens ride on the next sync (as when a sync fails)."""
        state = dict(state)
        steps, tokens = list(state["steps_since_sync"]), list(state["tokens_since_sync"])
        for e in state.get("in_flight", []):
            steps[int(e["fragment"])] += int(e["steps"])
            tokens[int(e["fragment"])] += float(e["tokens"])
        # A sparse wire's residuals are what some rank of the old world has not sent: they go.
        state.update(steps_since_sync=steps, tokens_since_sync=tokens, in_flight=[], sparse_ef=None)
        return state

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
        if state.get("retuned"):  # re-planned in an earlier session: go on with those settings
            self.retune({k: v for k, v in state["retuned"].items() if k in RETUNABLE})
        self.global_flat = [g.to("cpu", copy=True) for g in state["global"]]
        self.momentum = [m.to("cpu", copy=True) for m in state["momentum"]]
        self.steps_since_sync = [int(n) for n in state["steps_since_sync"]]
        self.tokens_since_sync = [float(n) for n in state["tokens_since_sync"]]
        self.outer_steps = int(state["outer_steps"])
        # Older checkpoints kept no per-fragment count: every fragment synced alike, up to one.
        self.fragment_syncs = [int(n) for n in state.get("fragment_syncs")
                               or [self.outer_steps // len(numels)] * len(numels)]
        self.in_flight = [
            _InFlight(int(e["fragment"]), int(e["apply_at"]), e["at_send"].to("cpu", copy=True), int(e["steps"]),
                      float(e["tokens"]), None, None if e["result"] is None else e["result"].to("cpu", copy=True),
                      None if e.get("sent") is None else e["sent"].to("cpu", copy=True))
            for e in state.get("in_flight", [])
        ]
        if self.ef is not None and state.get("sparse_ef") is not None:
            self.ef.load_state_dict(state["sparse_ef"])
        for entry in self.in_flight:
            if entry.sent is not None:  # saved while its reduction ran: run it again (all ranks do)
                self._submit(entry)
        for f, flat in enumerate(state.get("local") or []):
            self._write_local(f, flat)

    # -- the sparse wire (`sparse_wire.py`): top-k, low-bit, error feedback -----------------------

    def _sparse_setup(self) -> None:
        """On a sparse wire, this rank's residuals (zero at first; kept across a retune)."""
        if isinstance(self.codec, sparse_wire.SparseCodec) and self.ef is None and self.global_flat:
            self.ef = sparse_wire.ErrorFeedback([int(g.numel()) for g in self.global_flat])

    def _to_send(self, f: int, delta: "torch.Tensor") -> "torch.Tensor":
        """What the reduction gets: Δ_r, or on a sparse wire e + Δ_r (the residual added)."""
        if isinstance(self.codec, sparse_wire.SparseCodec) and self.ef is not None:
            return self.ef.accumulate(f, delta, self.codec)
        return delta

    def _sparse_done(self, f: int, landed: bool) -> None:
        """A sync of fragment f landed (the residual becomes what it did not send) or was skipped."""
        if self.ef is not None:
            self.ef.landed(f) if landed else self.ef.skipped(f)
