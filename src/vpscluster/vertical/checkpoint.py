"""A stage's checkpoint: its weights, its optimizer and how many gradient steps they hold.

    store = Store(queue, run_id)                  # the run's copy on the queue (None: the node's disk only)
    save(path, model, opt, applied, store=store, stage="image.1", counts=...)
    state = load(path, store=store, stage="image.1")   # the newest of both; None when there is none

Each save writes the node's file atomically (a kill leaves the previous one) and sends the same
bytes to the queue's object store (bucket `vtckpt_<run>`, one object per stage, its description
`{"applied": N}`), so a stage whose node is gone for good can resume on another node from
there (vertical/launch.py moves it). The upload is not waited for in the critical path: at most
one is in flight per stage, and the next save (or `Store.wait`) confirms it. A stage that dies
before it is confirmed resumes from the one before: any checkpoint is a correct start, since a
resumed stage reads its gradients anew from the stream.

A tower's holds `applied` (the steps it applied); the head's also the sample ids it trained on per
epoch (`counts`), so its report after a restart still counts every sample of the run.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def path_of(out_dir: str | Path, stage: str) -> Path:
    return Path(out_dir) / f"checkpoint-{stage}.pt"


def bucket_of(run_id: str) -> str:
    return f"vtckpt_{run_id}"


def step_on_queue(queue, run_id: str, stage: str) -> int | None:
    """The step of `stage`'s checkpoint on the queue (None: none there), without reading it."""
    desc = queue.object_description(bucket_of(run_id), stage)
    return None if desc is None else int(json.loads(desc)["applied"])


class Store:
    """The run's checkpoints on the queue's object store; one upload in flight per stage."""

    def __init__(self, queue, run_id: str, timeout_s: float = 60.0):
        self.queue, self.bucket, self.timeout_s = queue, bucket_of(run_id), timeout_s
        self._last: dict[str, tuple[Any, int]] = {}

    def put(self, stage: str, data: bytes, applied: int) -> None:
        self._confirm(stage)
        fut = self.queue.put_object_nowait(self.bucket, stage, data, json.dumps({"applied": applied}))
        self._last[stage] = (fut, applied)

    def get(self, stage: str) -> bytes | None:
        got = self.queue.get_object(self.bucket, stage, timeout_s=self.timeout_s)
        return None if got is None else got[0]

    def wait(self) -> None:
        for stage in list(self._last):
            self._confirm(stage)

    def _confirm(self, stage: str) -> None:
        from vpscluster.queue.client import QueueError

        if stage not in self._last:
            return
        fut, applied = self._last.pop(stage)
        try:
            fut.result(timeout=self.timeout_s + 2.0)
        except Exception as e:
            raise QueueError(f"queue: the upload of stage {stage}'s checkpoint (step {applied}) failed: "
                             f"{str(e).strip() or type(e).__name__}") from None


def save(path: Path, model, opt, applied: int, store: Store | None = None, stage: str | None = None,
         **extra: Any) -> None:
    """Weights and optimizer after `applied` steps (and `extra`: plain ints, floats, lists, dicts),
    on this node's disk and, with `store`, on the queue as `stage` (its name there: `image.1`)."""
    import io

    import torch

    from vpscluster import fsutil

    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "applied": applied, **extra}, buf)
    path.parent.mkdir(parents=True, exist_ok=True)
    fsutil.write_atomic(path, buf.getvalue())
    if store is not None:
        store.put(stage, buf.getvalue(), applied)


def load(path: Path, store: Store | None = None, stage: str | None = None) -> dict[str, Any] | None:
    """The newest checkpoint (the most steps) of this node's file and, with `store`, the queue's copy
    of `stage`; None when there is neither (a stage that died early)."""
    import io

    import torch

    found = [torch.load(path, weights_only=True)] if path.is_file() else []
    if store is not None:
        data = store.get(stage)
        if data is not None:
            found.append(torch.load(io.BytesIO(data), weights_only=True))
    return max(found, key=lambda s: int(s["applied"]), default=None)
