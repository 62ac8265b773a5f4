"""Joining the job: the process group a session (and so the built-in trainer) trains in.

- `init_distributed`: torchrun's env:// rendezvous with the long start-up time-out, or one
  process without a launcher (no group); `join_existing`: a group the script (or a test
  harness) created itself.
- `end_startup`: start-up is over, the same groups' time-out drops to the training one
  (torchtitan's init/train time-outs), so a dead peer stops the job quickly instead of hanging it.
- `release_groups`: after `destroy_process_group`, drop the references that would keep a
  destroyed group's C++ backend (and gloo's threads) alive into the interpreter's exit.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

from vpscluster.train.strategies.base import DistContext

# The job's key-value store, made once per process; every process group this process joins
# (a session closed and another started) gets a fresh prefix in it. Re-running env://
# rendezvous instead reuses the old keys: on torchrun's agent store (which outlives the group),
# or on rank 0's own store while a user's reference (their DDP model) keeps the old group
# alive, the second group then waits forever on keys of the first.
_STORE: Any = None
_JOINS = 0


def _job_store(timeout: timedelta):
    import torch.distributed as dist

    global _STORE, _JOINS
    if _STORE is None:
        _STORE, _, _ = next(dist.rendezvous("env://", timeout=timeout))
    _JOINS += 1
    return dist.PrefixStore(f"vpscluster/{_JOINS}", _STORE)


def init_distributed(startup_collective_s: float, backend: str) -> DistContext:
    """Join the job torchrun started (env:// rendezvous) with the long start-up time-out."""
    import torch
    import torch.distributed as dist

    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    device = torch.device("cuda", local_rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if "MASTER_ADDR" in os.environ:
        # Imported after the default group exists (a script's first optimizer imports it),
        # torch._dynamo keeps that group's gloo backend alive past destroy_process_group (torch
        # 2.13, seen here: its worker threads outlive `close`, into the interpreter's teardown;
        # release_groups). Imported first, it does not. Every loop with an optimizer pays it anyway.
        import torch._dynamo  # noqa: F401

        timeout = timedelta(seconds=startup_collective_s)
        dist.init_process_group(backend, store=_job_store(timeout), rank=rank, world_size=world, timeout=timeout)
        group = dist.group.WORLD
    else:
        group = None  # started without a launcher: a single process, nothing to join
    return DistContext(rank=rank, world_size=world, local_rank=local_rank, backend=backend, device=device, group=group)


def join_existing() -> DistContext:
    """The default group the caller already initialised (its backend decides the device)."""
    import torch
    import torch.distributed as dist

    backend = dist.get_backend()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if backend == "nccl" else torch.device("cpu")
    return DistContext(rank=dist.get_rank(), world_size=dist.get_world_size(), local_rank=local_rank,
                       backend=backend, device=device, group=dist.group.WORLD)


def end_startup(ctx: DistContext, train_collective_s: float, groups: list | tuple = ()) -> None:
    """Start-up is over: from now on a collective of `ctx.group` (and of `groups`, a strategy's
    own, `Strategy.collective_groups`) that waits longer than `train_collective_s` fails (a dead
    or stuck peer) instead of the start-up time-out."""
    if ctx.group is None:
        return
    from torch.distributed import distributed_c10d

    # What torchtitan does after its first step; gloo and NCCL both honour it. A torch without
    # it keeps the start-up time-out (slower to notice a dead peer, never wrong).
    set_timeout = getattr(distributed_c10d, "_set_pg_timeout", None)
    if set_timeout is not None:
        for group in (ctx.group, *groups):
            set_timeout(timedelta(seconds=train_collective_s), group)


def release_groups(*holders: Any) -> int:
    """Set every attribute of `holders` that is a process group to None; the count dropped.

    `destroy_process_group` only unregisters a group: its C++ backend (gloo's worker and I/O
    threads) lives on while any Python reference holds it (the context's `group`, a strategy's
    sync or agreement group), and is then freed wherever the last reference goes - for a user's
    script, in the interpreter's teardown. A gloo worker that still drops its last finished
    work there (tensors whose Python objects it owns) takes the GIL of a finalizing interpreter,
    is ended by pthread_exit inside a noexcept destructor, and the process aborts
    ("terminate called without an active exception", SIGABRT; pytorch PR 179291 describes it for
    a group never destroyed). Dropped here, the backend is freed at once: its destructor drains
    the work queue and joins the threads while the interpreter is whole."""
    import torch.distributed as dist

    dropped = 0
    for holder in holders:
        if holder is None:
            continue
        for name, value in list(vars(holder).items()):
            if isinstance(value, dist.ProcessGroup):
                setattr(holder, name, None)
                dropped += 1
    return dropped
