"""Machine-readable progress events on rank 0's stdout: the trainer <-> launcher protocol.

One event per line, flushed, in the form

    VPSC_EVENT {"event": "start"|"step"|"eval"|"checkpoint"|"resume"|"end"|"error"|"rebalance"|"checkpoint_failed"|"prediction"|"replan"|"stopping"|"replicas_diverged"|"drained", ...}

so a launcher reading a worker's merged output (local pipes or SSH) can tell events from
ordinary log lines without a second channel. `end` carries {"report": {...}}.
"""

from __future__ import annotations

import json
import sys
from typing import Any, TextIO

PREFIX = "VPSC_EVENT "
KINDS = ("start", "step", "eval", "checkpoint", "resume", "end", "error", "rebalance", "checkpoint_failed", "prediction", "replan",
         "stopping", "replicas_diverged", "drained")


def format_event(event: str, **fields: Any) -> str:
    if event not in KINDS:
        raise ValueError(f"unknown event {event!r}; known: {', '.join(KINDS)}")
    return PREFIX + json.dumps({"event": event, **fields}, separators=(",", ":"), default=str)


def parse_event(line: str) -> dict[str, Any] | None:
    """The event a line carries, or None for an ordinary log line (or a garbled event)."""
    i = line.find(PREFIX)  # launchers may prefix lines (e.g. "[rank0]: ")
    if i < 0:
        return None
    try:
        doc = json.loads(line[i + len(PREFIX) :])
    except ValueError:
        return None
    return doc if isinstance(doc, dict) and "event" in doc else None


class EventWriter:
    """Writes events to a stream (rank 0's stdout)."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self.stream = stream or sys.stdout

    def emit(self, event: str, **fields: Any) -> None:
        self.stream.write(format_event(event, **fields) + "\n")
        self.stream.flush()


class NullEventWriter:
    """Other ranks: events are rank 0's job, so every call does nothing."""

    def emit(self, event: str, **fields: Any) -> None:
        pass


def event_writer(rank: int, stream: TextIO | None = None) -> EventWriter | NullEventWriter:
    return EventWriter(stream) if rank == 0 else NullEventWriter()
