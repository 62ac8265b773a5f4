"""A training run's events, read as they arrive, for benchmarks that act at a given step.

    events = RunEvents(run_dir); events.poll(); events.step; events.since(t, "start")

The launcher writes every node's output to RUN_DIR/logs/<node>.log as it streams in; rank 0's
`VPSC_EVENT` lines (train/events.py) are among them. Each poll reads only what was appended
since the last one.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any


class RunEvents:
    """Rank 0's events as they reach the launcher's per-node logs, each with its arrival time."""

    def __init__(self, run_dir: Path) -> None:
        self.logs = run_dir / "logs"
        self.offsets: dict[Path, int] = {}
        self.seen: list[tuple[float, dict[str, Any]]] = []
        self.step = 0

    def poll(self) -> None:
        from vpscluster.train.events import parse_event

        now = time.time()
        for p in sorted(self.logs.glob("*.log")) if self.logs.is_dir() else []:
            with p.open("rb") as f:
                f.seek(self.offsets.get(p, 0))
                data = f.read()
            end = data.rfind(b"\n") + 1  # whole lines only
            self.offsets[p] = self.offsets.get(p, 0) + end
            for line in data[:end].decode(errors="replace").splitlines():
                ev = parse_event(line)
                if ev is not None:
                    self.seen.append((now, ev))
                    if ev["event"] == "step":
                        self.step = int(ev.get("step", self.step))

    def since(self, t: float, kind: str) -> list[tuple[float, dict[str, Any]]]:
        return [(at, ev) for at, ev in self.seen if at >= t and ev["event"] == kind]
