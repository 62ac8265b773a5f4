"""Per-step metrics: `metrics.jsonl` lines on rank 0, running totals on every rank.

`MetricsLog` appends one JSON line per step (step, loss, step_seconds, compute_seconds,
comm_seconds, tokens, bytes_sent, lr) and one per evaluation (step, val_loss). Other ranks get a
`NullMetricsLog`, so the loop never asks which rank it is. `Totals` are the cumulative figures
every rank keeps (and checkpoints) for the report.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any


@dataclass
class Totals:
    """Cumulative counters of one rank, carried across resumes through checkpoints."""

    steps: int = 0
    tokens: int = 0
    wall_seconds: float = 0.0
    compute_seconds: float = 0.0
    comm_seconds: float = 0.0
    bytes_sent: int = 0
    initial_val_loss: float | None = None  # before step 1 of the first session

    def add_step(self, tokens: int, step_s: float, comm_s: float, nbytes: int) -> None:
        self.steps += 1
        self.tokens += tokens
        self.compute_seconds += max(0.0, step_s - comm_s)
        self.comm_seconds += comm_s
        self.bytes_sent += nbytes

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Totals":
        return cls(**d)


class MetricsLog:
    """Appends whole lines, unbuffered: a crash loses at most the line being written, and a line
    the disk has no room for is dropped and counted (`diskfull`), the training goes on."""

    def __init__(self, path: Path) -> None:
        from vpscluster.train.diskfull import AppendFile

        self.path = Path(path)
        self._f = AppendFile(self.path)

    def log(self, **fields: Any) -> None:
        self._f.write(json.dumps(fields, separators=(",", ":")) + "\n")

    def close(self) -> None:
        self._f.close()


class NullMetricsLog:
    def log(self, **fields: Any) -> None:
        pass

    def close(self) -> None:
        pass


def metrics_log(rank: int, path: Path) -> MetricsLog | NullMetricsLog:
    return MetricsLog(path) if rank == 0 else NullMetricsLog()


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The file's lines; a missing file is empty and a torn line (a crash mid-write, a fetch cut
    off) is skipped, so what could be read is never lost over what could not."""
    try:
        text = Path(path).read_text(errors="replace")
    except OSError:
        return []
    out = []
    for raw in text.splitlines():
        try:
            line = json.loads(raw)
        except ValueError:
            continue
        if isinstance(line, dict):
            out.append(line)
    return out


def truncate_after(path: Path, step: int) -> None:
    """Drop lines past `step` (a resume restarts from a checkpoint; later lines would repeat).

    Truncates in place, so an append handle already open on the file stays valid.
    """
    p = Path(path)
    if not p.exists():
        return
    keep_bytes = 0
    with p.open("rb+") as f:
        for raw in f:
            try:
                if json.loads(raw).get("step", 0) > step:
                    break
            except ValueError:
                break  # a torn last line from a crash: drop it and everything after
            keep_bytes += len(raw)
        f.truncate(keep_bytes)


def merge_launch(history: list[dict[str, Any]], launch: list[dict[str, Any]], resumed_from: int) -> list[dict[str, Any]]:
    """A run's metrics across relaunches whose rank 0 ran on different nodes (recovery moved the
    head, or took a node back): each node's file holds only what rank 0 wrote there.

    `launch` is one launch's file, resumed from the checkpoint of step `resumed_from` (0: from
    the start). Its lines past that step are what this launch trained: they replace anything
    the history has past it (training a restart threw away). Its lines up to that step are the
    node's older copy: they only fill steps the history lacks. A step line and an evaluation
    line at the same step are kept apart."""
    def key(line: dict[str, Any]) -> tuple[int, bool]:
        return int(line.get("step", 0)), "val_loss" in line

    kept = {key(x): x for x in history if key(x)[0] <= resumed_from}
    for x in launch:
        k = key(x)
        if k[0] > resumed_from or k not in kept:
            kept[k] = x
    return [kept[k] for k in sorted(kept)]


def write_metrics(path: Path, lines: list[dict[str, Any]]) -> None:
    """Replace `path` with `lines` (written aside, then renamed: a reader never sees half)."""
    p = Path(path)
    tmp = p.with_name(p.name + ".tmp")
    tmp.write_text("".join(json.dumps(x, separators=(",", ":")) + "\n" for x in lines))
    tmp.replace(p)
