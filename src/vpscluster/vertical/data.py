"""The rows of a vertical split and how they are divided: per-node column files and the batch schedule.

The launcher reads the whole dataset (JSON lines) once and writes, for each stage, a file holding
only what that stage may see: a tower gets the id column and its own columns, the head the id
column and the label. Nothing else travels to a node.

The batch schedule is a pure function of the ids and the seed, so every stage computes the same
one without a control channel: a fixed validation split, then a new order of the training ids
each epoch. The head checks every batch's ids against it and counts each sample once per epoch.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from vpscluster.errors import UserError


def read_rows(path: str | Path) -> list[dict[str, Any]]:
    """Every row of a JSON-lines file; one UserError line for a file that is not one."""
    p = Path(path)
    rows = []
    try:
        with p.open() as f:
            for i, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except ValueError:
                    raise UserError(f"data {p}: line {i} is not JSON; give one JSON object per line") from None
                if not isinstance(row, dict):
                    raise UserError(f"data {p}: line {i} is not a JSON object (column: value)")
                rows.append(row)
    except OSError as e:
        raise UserError(f"data {p}: cannot read it ({e.strerror}); give --data or the spec's data:") from None
    if not rows:
        raise UserError(f"data {p}: no rows")
    return rows


def columns_of(rows: list[dict[str, Any]]) -> set[str]:
    return set().union(*(r.keys() for r in rows))


def check_ids(rows: list[dict[str, Any]], id_column: str) -> list[int]:
    ids = [r.get(id_column) for r in rows]
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise UserError(f"data: {id_column} must be an integer in every row (the sample id the head counts)")
    if len(set(ids)) != len(ids):
        raise UserError(f"data: {id_column} repeats a value; every row needs its own id")
    return ids


def write_columns(rows: list[dict[str, Any]], columns: list[str], path: str | Path) -> Path:
    """Write only `columns` of every row (JSON lines): the file a stage's node receives."""
    from vpscluster import fsutil

    text = "".join(json.dumps({c: r[c] for c in columns}, separators=(",", ":")) + "\n" for r in rows)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    return fsutil.write_atomic(path, text)


def owner_of(ids, replicas: int) -> dict[int, int]:
    """id -> the replica that holds its row: position in the sorted ids modulo `replicas` (the
    launcher splits the rows with it, the head joins the shares with it)."""
    return {i: k % replicas for k, i in enumerate(sorted(ids))}


def write_ids(ids, path: str | Path) -> Path:
    """Every sample id and nothing else: what a tower's replica needs besides its share of the
    rows to compute the schedule every stage follows."""
    from vpscluster import fsutil

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    return fsutil.write_atomic(path, json.dumps(sorted(ids)) + "\n")


def read_ids(path: str | Path) -> list[int]:
    try:
        ids = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"ids file {path}: cannot read it ({e}); the launcher writes it beside the rows") from None
    if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
        raise UserError(f"ids file {path}: not a list of integer ids")
    return ids


@dataclass(frozen=True)
class Batch:
    step: int  # 0, 1, ... over the whole run (train); 0, 1, ... within an evaluation
    epoch: int
    ids: tuple[int, ...]


@dataclass(frozen=True)
class Schedule:
    """Which ids form which batch: the same in every stage (a function of the ids and the seed)."""

    ids: tuple[int, ...]
    batch_size: int
    epochs: int
    seed: int
    val_fraction: float
    max_steps: int | None = None  # None: every epoch in full

    def _split(self) -> tuple[list[int], list[int]]:
        import torch

        order = sorted(self.ids)
        g = torch.Generator().manual_seed(self.seed)
        perm = torch.randperm(len(order), generator=g).tolist()
        n_val = int(round(len(order) * self.val_fraction))
        return sorted(order[i] for i in perm[n_val:]), sorted(order[i] for i in perm[:n_val])

    @property
    def train_ids(self) -> list[int]:
        return self._split()[0]

    @property
    def val_ids(self) -> list[int]:
        return self._split()[1]

    @property
    def steps_per_epoch(self) -> int:
        return math.ceil(len(self.train_ids) / self.batch_size)

    @property
    def steps(self) -> int:
        total = self.steps_per_epoch * self.epochs
        return total if self.max_steps is None else min(total, self.max_steps)  # 0: evaluation only

    def train_batches(self) -> Iterator[Batch]:
        import torch

        train = self.train_ids
        step = 0
        for epoch in range(self.epochs):
            g = torch.Generator().manual_seed(self.seed + 1 + epoch)
            perm = torch.randperm(len(train), generator=g).tolist()
            for i in range(0, len(train), self.batch_size):
                if step >= self.steps:
                    return
                yield Batch(step, epoch, tuple(train[j] for j in perm[i:i + self.batch_size]))
                step += 1

    def eval_batches(self, ids: list[int]) -> Iterator[Batch]:
        for k, i in enumerate(range(0, len(ids), self.batch_size)):
            yield Batch(k, -1, tuple(ids[i:i + self.batch_size]))


def schedule_for(spec, ids: list[int], train: bool = True) -> Schedule:
    """The spec's schedule over `ids`; `train=False`: no training steps (a prediction run)."""
    t = spec.train
    return Schedule(tuple(ids), t.batch_size, t.epochs, t.seed, t.val_fraction, t.steps if train else 0)
