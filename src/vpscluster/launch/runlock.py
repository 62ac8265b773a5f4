"""One launcher per run: an exclusive lock on the local run directory, held for the launcher's life.

Two launchers on one run (a `train --resume RUN` typed while the first still runs, a second
`--detach`) would start duplicate ranks writing the same checkpoint steps. So the launcher
takes `RUN_DIR/launcher.lock` with `flock(LOCK_EX | LOCK_NB)` before it starts anything, and
keeps it until it returns. The kernel drops the lock when the process ends however it ends
(SIGKILL, a crash), so a dead launcher never blocks the next one; nothing has to be cleaned up.
The file holds who holds it (`{"pid", "host", "started", "argv"}`) for the refusal to name.

    lock = RunLock(run_dir); lock.acquire()    # UserError (one line) when another launcher holds it
    ...; lock.release()
    holder(run_dir) -> dict | None             # who holds it now (None: free)

The nodes keep a lock of their own (the node-side guard, `nodeside/reap.py`): a second launch of
the same run is refused there while the first's processes live, even from another machine or
after the first launcher died and left workers behind.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

from vpscluster.errors import UserError

LOCK = "launcher.lock"


class RunLock:
    """The run directory's launcher lock; `acquire` is idempotent, `release` safe to repeat."""

    def __init__(self, run_dir: str | os.PathLike):
        self.run_dir = Path(run_dir)
        self.fd: int | None = None

    def acquire(self) -> None:
        if self.fd is not None:
            return
        fd = _open(self.run_dir)
        if not _try_lock(fd):
            doc = _read(fd)
            os.close(fd)
            raise refusal(self.run_dir, doc)
        record = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time(), "argv": sys.argv[1:]}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(record).encode(), 0)
        self.fd = fd

    def release(self) -> None:
        if self.fd is None:
            return
        try:
            os.ftruncate(self.fd, 0)  # a file left behind names nobody
        except OSError:
            pass
        os.close(self.fd)  # closing drops the lock
        self.fd = None


def holder(run_dir: str | os.PathLike) -> dict[str, Any] | None:
    """Who holds the run's launcher lock now ({"pid", "host", ...}), or None when it is free."""
    path = Path(run_dir) / LOCK
    if not path.is_file():
        return None
    fd = _open(Path(run_dir))
    try:
        if _try_lock(fd):
            fcntl.flock(fd, fcntl.LOCK_UN)
            return None
        return _read(fd)
    finally:
        os.close(fd)


def refusal(run_dir: Path, doc: dict[str, Any]) -> UserError:
    """The one-line refusal naming the live launcher and what to do."""
    pid, host = doc.get("pid", "?"), doc.get("host", "?")
    since = time.strftime("%H:%M:%S", time.localtime(doc["started"])) if isinstance(doc.get("started"), (int, float)) else "?"
    from vpscluster.launch import detached

    state = detached.read_state(run_dir) or {}
    if state.get("pid") == pid and host == socket.gethostname():  # a --detach launcher: stop and attach reach it
        fix = f"follow it with `vpscluster attach {run_dir}` or stop it with `vpscluster stop {run_dir}`"
    else:
        fix = (f"stop it first (Ctrl-C in its terminal, or `kill {pid}` on {host}: it saves a checkpoint), "
               f"then resume with `vpscluster train --resume {run_dir}`")
    return UserError(f"run {run_dir} already has a launcher running (pid {pid} on {host}, since {since}); "
                     f"a second one would start duplicate ranks: {fix}")


def _open(run_dir: Path) -> int:
    try:
        # O_CLOEXEC: the workers it starts must not hold the launcher's lock after it is gone.
        return os.open(run_dir / LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as e:
        raise UserError(f"run {run_dir}: cannot open its lock file {LOCK} ({e.strerror}); check the folder's permissions") from None


def _try_lock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError as e:
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return False
        raise


def _read(fd: int) -> dict[str, Any]:
    try:
        doc = json.loads(os.pread(fd, 65536, 0) or b"{}")
    except (OSError, ValueError):
        return {}
    return doc if isinstance(doc, dict) else {}
