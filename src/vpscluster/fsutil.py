"""Writing files so that a reader, or a crash, never sees half of one (core: stdlib only).

`write_atomic` is the one way the package replaces a file it owns (probe results, the
calibration cache, a run's config and report, checkpoint shards and manifests, the sandbox's
state): a temporary file beside the target, fsync'ed, renamed over it with `os.replace`
(atomic on POSIX), then the folder fsync'ed so the rename itself survives a power cut.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def write_atomic(path: str | Path, data: str | bytes) -> Path:
    """Replace `path` with `data` (text is UTF-8): the old content or the new, never a mix.

    The folder must exist. On failure the temporary file is removed and the error raised.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with tmp.open("wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)
    return path


def write_json(path: str | Path, doc: Any, indent: int | None = 2) -> Path:
    """`write_atomic` of `doc` as JSON, with a final newline."""
    return write_atomic(path, json.dumps(doc, indent=indent) + "\n")


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return  # a folder that cannot be opened for reading: the rename is done, only not flushed
    try:
        os.fsync(fd)
    except OSError:
        pass  # some file systems refuse fsync on a folder
    finally:
        os.close(fd)


def read_cache(path: str | Path) -> dict:
    """A JSON object cached on disk, or {} when it is missing, unreadable or not an object."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def write_cache(path: str | Path, doc: dict) -> None:
    """Write a cache atomically, best effort: a read-only home only loses the cache, not the figures."""
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        write_json(path, doc)
    except OSError:
        pass
