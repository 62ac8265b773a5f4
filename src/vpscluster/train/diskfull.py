"""Log and metrics writes that survive a full disk: what cannot be written is dropped and counted.

A rank writes every printed line to its log (`worker._Tee`), and rank 0 a metrics line per step
(`metrics.MetricsLog`): with the node's disk full each of those raised ENOSPC and ended the
training, although checkpoints already survive a full disk (`checkpoint.CheckpointFailed`). Here a
write that finds the disk full (ENOSPC, EDQUOT) is dropped whole, counted in `DROPPED`, and the
first one says so once on the process's real stderr; the next write tries again, so the files
go on once there is room. The report carries the count (`log_lines_dropped`).

`AppendFile` writes a line with `os.write` on an O_APPEND descriptor: no buffer holds a failed
line to fail again at the next write or at close, and a line cut short by the full disk is
truncated away, so a reader (`metrics.read_metrics`, `metrics.truncate_after`) never meets a
torn line in the middle of the file.
"""

from __future__ import annotations

import errno
import os
import sys
import threading
from pathlib import Path

DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


def is_disk_full(e: BaseException) -> bool:
    return isinstance(e, OSError) and e.errno in DISK_FULL


class _Dropped:
    """Lines dropped in this process (all files together); warns once on the real stderr."""

    def __init__(self) -> None:
        self.count = 0
        self._lock = threading.Lock()
        self._warned = False

    def add(self, what: str, e: OSError, lines: int) -> None:
        """`lines`: the line ends in the text dropped (a print's text and its newline are two writes)."""
        with self._lock:
            self.count += lines
            if self._warned:
                return
            self._warned = True
        rank = os.environ.get("RANK", "0")
        try:  # the real stderr: the rank's log (the tee) is what cannot be written
            sys.__stderr__.write(f"warning: rank {rank}: {what}: {e.strerror or e}; log and metrics lines are dropped "
                                 "while the disk is full (the report counts them), training goes on\n")
            sys.__stderr__.flush()
        except (OSError, ValueError, AttributeError):  # stderr on the same full disk, or closed
            pass


DROPPED = _Dropped()


class AppendFile:
    """A text file written line by line with O_APPEND; `write` drops (and counts) what a full disk refuses."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._fd: int | None = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._lock = threading.Lock()

    def write(self, text: str) -> bool:
        """Write `text` whole, or nothing (False: the disk is full; counted in DROPPED)."""
        data = text.encode("utf-8", errors="replace")
        with self._lock:
            if self._fd is None or not data:
                return self._fd is not None
            before = None
            try:
                before = os.fstat(self._fd).st_size
                view = memoryview(data)
                while view:
                    view = view[os.write(self._fd, view):]
                return True
            except OSError as e:
                if not is_disk_full(e):
                    raise
                if before is not None:
                    try:  # a line cut short: take its start back (truncating frees space, it cannot fail on that)
                        os.ftruncate(self._fd, before)
                    except OSError:
                        pass
                DROPPED.add(f"cannot write {self.path}", e, data.count(b"\n"))
                return False

    def close(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None
