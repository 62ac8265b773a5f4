"""Checkpoints: per-rank shards written atomically, a manifest, and a resume all ranks agree on.

Layout (under the run directory's `checkpoints/`, on each node's own disk):

    step-00000200/
      rank-00000.pt      one shard per rank: model, optimizer, strategy state (DiLoCo's is
      rank-00001.pt      rank-local), data-sampler position, RNG states, running totals
      manifest.json      {"step", "world_size", "sha256": {rank: hex}} — written after every
                         rank's shard is on disk (the shas are gathered, which is the barrier)

Writing: the shard is serialised in memory, hashed (sha256), written to a temporary file,
fsync'ed, renamed over the final name, and the directory fsync'ed — a crash leaves either the
old state or the complete new file, never a torn one under the final name. Only the last
`keep` complete checkpoints are kept. A rank that cannot write (a full disk) makes the whole
checkpoint fail the same way on every rank (CheckpointFailed): its directory goes, nothing older
is pruned, and the run goes on; the next checkpoint tries again.

Resuming: every rank lists the step directories it can see, and checks for each one that the
manifest exists and is readable and that its own shard's sha256 matches. The ranks gather their
lists and take the newest step valid on ALL ranks (and taken with one world size). A torn or
corrupt checkpoint costs one warning line and the previous good one is used; the unusable
directories newer than the chosen step are renamed aside (`*.abandoned-<time>`), never deleted,
so the resumed run does not overwrite evidence.

Loading runs no code from the file: shards load with `torch.load(weights_only=True)`, which
rebuilds only tensors, numbers, strings and containers, plus the numpy arrays that PowerSGD's
random state holds (`SAFE_GLOBALS`). A shard naming anything else (a class, a function: what
a pickle's `__reduce__` would call) is refused in one line (`UnsafeCheckpoint`), so resuming
a run folder from someone else cannot run their code. The sha256 manifest does not help there:
whoever wrote the shard wrote its manifest too.

Resuming on another number of ranks (a node died and the run goes on without it, or one was
added): a checkpoint taken with W ranks serves a run of W' ranks. Each rank then loads a shard
held on its own disk (the one of its old rank when a node keeps its place; any intact one, by
local rank, on a shared disk) — replicated state (DDP's model and optimizer, DiLoCo's global
weights and outer momentum) is the same in every shard; rank-local state is the caller's to
adapt (`ResumePoint.recut` says that some rank's shard is not its own of this world). A rank
whose disk lacks the step altogether (a node back from a long outage, a replacement) receives
a shard from the lowest rank that holds it, over the process group — where the caller gives
`Collectives.broadcast_object` — so the run goes on from the newest checkpoint, not an older
one every node happens to hold.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from vpscluster.errors import UserError
from vpscluster.fsutil import write_atomic

MANIFEST = "manifest.json"
FORMAT = 1
ABSENT = "missing on a node"  # a step some rank cannot see at all (not torn, not corrupt)
NOT_HERE = " and no shard of it is on this node"


def step_dir(root: Path, step: int) -> Path:
    return Path(root) / f"step-{step:08d}"


def shard_path(root: Path, step: int, rank: int) -> Path:
    return step_dir(root, step) / f"rank-{rank:05d}.pt"


def _list_steps(root: Path) -> list[int]:
    steps = []
    if Path(root).is_dir():
        for d in Path(root).iterdir():
            name = d.name
            if d.is_dir() and name.startswith("step-") and name[5:].isdigit():
                steps.append(int(name[5:]))
    return sorted(steps)


@dataclass
class Collectives:
    """The two collectives checkpointing needs; identity functions at world size 1."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    all_gather_object: Callable[[Any], list[Any]] = field(default=lambda obj: [obj])
    # (obj, src) -> src's obj on every rank; None: no rank can receive a checkpoint it lacks.
    broadcast_object: Callable[[Any, int], Any] | None = None


class UnsafeCheckpoint(UserError):
    """A shard that names something other than plain data: not loaded, nothing in it ran."""


def _safe_globals() -> list:
    """What a shard may name besides torch's own plain types: numpy arrays (PowerSGD's
    `RandomState.get_state()`), rebuilt from their bytes, never a call to arbitrary code."""
    import numpy as np

    try:
        from numpy._core.multiarray import _reconstruct  # numpy 2
    except ImportError:  # numpy 1
        from numpy.core.multiarray import _reconstruct
    return [np.ndarray, np.dtype, _reconstruct,
            *{type(np.dtype(t)) for t in "?" + np.typecodes["AllInteger"] + np.typecodes["AllFloat"]}]


def load_shard(data: bytes | Path, where: str | Path) -> dict[str, Any]:
    """A shard's payload (`data`: its bytes, or its path), tensors on the CPU. Raises
    `UnsafeCheckpoint` (one line naming `where` and what it names) for anything but plain data."""
    import pickle

    import torch

    source = io.BytesIO(data) if isinstance(data, (bytes, bytearray)) else data
    scoped = getattr(torch.serialization, "safe_globals", None)  # torch >= 2.5; 2.4: process-wide
    if scoped is None:
        torch.serialization.add_safe_globals(_safe_globals())
    try:
        with scoped(_safe_globals()) if scoped is not None else contextlib.nullcontext():
            return torch.load(source, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        import re

        named = re.search(r"GLOBAL (\S+)", str(e))  # torch's message names the first global it refused
        what = named.group(1) if named else "something other than plain data"
        raise UnsafeCheckpoint(
            f"checkpoint {where}: refused, it names {what}, which is not plain data (tensors, numbers, "
            "strings, numpy arrays); loading it could run code from whoever wrote it, so it was not loaded "
            "(resume only run folders you or vpscluster wrote)") from None


class CheckpointFailed(Exception):
    """A checkpoint could not be written on some rank (e.g. a full disk); the previous ones are intact."""


def save(root: Path, step: int, payload: dict[str, Any], coll: Collectives, keep: int) -> Path:
    """Write this rank's shard for `step`, then (local rank 0) the manifest; prune old ones.

    Collective. When any rank cannot write (a full disk, an I/O error), every rank raises
    CheckpointFailed after the same collectives: the new step's directory is removed, nothing
    older is pruned, so the previous complete checkpoint stays the one a resume takes.
    """
    import torch

    d = step_dir(root, step)
    error = None
    data = b""
    try:
        d.mkdir(parents=True, exist_ok=True)
        buf = io.BytesIO()
        torch.save({"format": FORMAT, "step": step, "rank": coll.rank, "world_size": coll.world_size, **payload}, buf)
        data = buf.getvalue()
        write_atomic(shard_path(root, step, coll.rank), data)
    except OSError as e:
        error = f"rank {coll.rank}: {e.strerror or e}"
    digests = coll.all_gather_object(hashlib.sha256(data).hexdigest() if error is None else {"error": error})  # also the barrier
    errors = [x["error"] for x in digests if isinstance(x, dict)]
    if not errors and coll.local_rank == 0:
        manifest = {"step": step, "world_size": coll.world_size, "sha256": {str(r): h for r, h in enumerate(digests)}}
        try:
            write_atomic(d / MANIFEST, json.dumps(manifest, indent=1).encode())
        except OSError as e:
            error = f"rank {coll.rank} (manifest): {e.strerror or e}"
    if not errors:  # every node must hold its manifest before any node prunes an older step
        errors = [x for x in coll.all_gather_object(error) if x]
    if errors:
        if coll.local_rank == 0:
            shutil.rmtree(d, ignore_errors=True)
        raise CheckpointFailed(f"checkpoint step {step} not written ({'; '.join(errors)})")
    if coll.local_rank == 0:
        _prune(root, keep)
    return d


def _prune(root: Path, keep: int) -> None:
    complete = [s for s in _list_steps(root) if (step_dir(root, s) / MANIFEST).exists()]
    for s in complete[:-keep]:
        shutil.rmtree(step_dir(root, s), ignore_errors=True)


def verify_shard(root: Path, step: int, rank: int, world_size: int) -> str | None:
    """None if this rank's shard of `step` is complete and intact (in a run of `world_size`
    ranks), else why not."""
    return check_step(root, step, rank, rank, world_size).problem


@dataclass(frozen=True)
class StepCheck:
    problem: str | None  # None: this rank can resume from the step
    shard: int | None = None  # the rank whose shard this rank loads
    world_size: int | None = None  # the ranks the step was taken with


def check_step(root: Path, step: int, rank: int, local_rank: int, world_size: int) -> StepCheck:
    """Can this rank resume from `step`, and from which shard? Its own when the step was taken
    with `world_size` ranks; else an intact shard on this disk (see the module's note)."""
    d = step_dir(root, step)
    try:
        manifest = json.loads((d / MANIFEST).read_text())
    except FileNotFoundError:
        return StepCheck("incomplete (no manifest)")
    except (OSError, ValueError):
        return StepCheck("manifest unreadable")
    taken = manifest.get("world_size")
    shas = manifest.get("sha256", {})
    if not isinstance(taken, int) or not isinstance(shas, dict):
        return StepCheck("manifest unreadable")
    if taken == world_size:
        wanted = [rank]
    else:  # its own old shard first where this node kept its place, then the others held here
        held = sorted(int(r) for r in shas if str(r).isdigit() and shard_path(root, step, int(r)).exists())
        if not held:
            return StepCheck(f"taken with {taken} ranks{NOT_HERE}", None, taken)
        start = held.index(rank) if rank in held else local_rank % len(held)
        wanted = held[start:] + held[:start]
    problem = None
    for r in wanted:
        try:
            got = hashlib.sha256(shard_path(root, step, r).read_bytes()).hexdigest()
        except OSError:
            problem = problem or f"rank {r} shard missing"
            continue
        if got == shas.get(str(r)):
            return StepCheck(None, r, taken)
        problem = problem or f"rank {r} shard checksum mismatch"
    return StepCheck(problem, None, taken)


@dataclass
class ResumePoint:
    step: int | None  # None: nothing usable, start from scratch
    payload: dict[str, Any] | None
    skipped: list[dict[str, Any]]  # [{"step", "reason"}] newer checkpoints that were unusable
    world_size: int | None = None  # the ranks the checkpoint was taken with
    shard: int | None = None  # whose shard this rank loaded (its own unless the world changed)
    # Some rank's shard is not its own in this world (the world changed, or a rank received
    # one): rank-local state must be adapted, the same way on every rank.
    recut: bool = False
    received: bool = False  # this rank's disk lacked the step: its shard came over the network


def find_and_load(root: Path, coll: Collectives, warn: Callable[[str], None] | None = None) -> ResumePoint:
    """The newest checkpoint valid on every rank, loaded for this rank (collective: call on all)."""
    warn = warn or (lambda msg: print(msg, file=sys.stderr, flush=True))
    checks = {s: check_step(root, s, coll.rank, coll.local_rank, coll.world_size) for s in _list_steps(root)}
    everyone = coll.all_gather_object({s: (c.problem, c.world_size) for s, c in checks.items()})
    candidates = set().union(*(set(m) for m in everyone))

    def holders(s: int) -> list[int]:
        return [r for r, m in enumerate(everyone) if s in m and m[s][0] is None]

    def problems(s: int) -> set[str]:  # why some rank cannot resume from step s (empty: all can)
        found = {m[s][0] if s in m else ABSENT for m in everyone} - {None}
        if found == {ABSENT} and holders(s) and coll.broadcast_object is not None:
            found = set()  # the ranks without it receive it
        if not found and len({everyone[r][s][1] for r in holders(s)}) > 1:
            found = {"the nodes' manifests disagree on its world size"}
        return found

    valid = [s for s in candidates if not problems(s)]
    chosen = max(valid) if valid else None
    skipped = []
    for s in sorted(candidates, reverse=True):
        if chosen is not None and s <= chosen:
            break
        why = problems(s)
        skipped.append({"step": s, "reason": "; ".join(sorted(why)),
                        "absent": all(w == ABSENT or w.endswith(NOT_HERE) for w in why)})
    if coll.rank == 0:
        for item in skipped:
            target = f"resuming from step {chosen}" if chosen is not None else "starting from step 0"
            kept = "left in place" if item["absent"] else "kept aside, not deleted"
            warn(f"warning: checkpoint step {item['step']} is unusable ({item['reason']}); {target}; {kept}")
    if coll.local_rank == 0:
        stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
        for item in (i for i in skipped if not i["absent"]):  # intact where it is: copy it, resume again
            try:
                step_dir(root, item["step"]).rename(Path(str(step_dir(root, item["step"])) + f".abandoned-{stamp}"))
            except OSError:
                pass  # another node sharing this disk moved it already, or it only exists elsewhere
    coll.all_gather_object(None)  # nobody writes a new step-N before the old one is moved aside
    if chosen is None:
        return ResumePoint(None, None, skipped)
    have = holders(chosen)
    src = have[0]
    taken = everyone[src][chosen][1]
    lacking = len(have) < coll.world_size
    check = checks.get(chosen) if coll.rank in have else None
    if lacking:  # one broadcast of the lowest holder's shard, which those without the step keep
        assert coll.broadcast_object is not None
        sent = shard_path(root, chosen, check.shard).read_bytes() if coll.rank == src else None
        got = coll.broadcast_object((sent, check.shard if coll.rank == src else None), src)
        if check is None:
            data, shard = got
            payload = load_shard(data, f"step {chosen}, rank {shard}'s shard (received from rank {src})")
            return ResumePoint(chosen, payload, skipped, taken, shard, recut=True, received=True)
    path = shard_path(root, chosen, check.shard)
    payload = load_shard(path.read_bytes(), path)
    return ResumePoint(chosen, payload, skipped, taken, check.shard, recut=lacking or taken != coll.world_size)


def state_hash(obj: Any) -> str:
    """sha256 over a (nested) state dict: tensors by dtype, shape and bytes; keys in sorted order."""
    import torch

    h = hashlib.sha256()

    def feed(x: Any) -> None:
        if isinstance(x, torch.Tensor):
            h.update(f"T{x.dtype}{tuple(x.shape)}".encode())
            flat = x.detach().cpu().contiguous().reshape(-1)
            h.update(flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b"")
        elif isinstance(x, dict):
            h.update(b"{")
            for k in sorted(x, key=str):
                h.update(repr(k).encode())
                feed(x[k])
            h.update(b"}")
        elif isinstance(x, (list, tuple)):
            h.update(b"[")
            for v in x:
                feed(v)
            h.update(b"]")
        else:
            h.update(repr(x).encode())

    feed(obj)
    return h.hexdigest()
