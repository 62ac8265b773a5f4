"""What vpscluster records about a cluster file, kept next to it.

A record of kind K for `cluster.yaml` is `<its folder>/.vpscluster/cluster.K.json`, or, where that
folder cannot be written, `~/.cache/vpscluster/cluster-<hash of its path>.K.json`. The overlay
(`overlay.py`) and the provisioned venvs (`venv.py`) are such records; the local cluster (no
file) has none.

    candidates(cluster, kind) -> [Path, ...]   where to look, in order
    save(cluster, kind, doc, what) -> Path     written atomically to the first that takes it
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from vpscluster import fsutil


def candidates(cluster, kind: str) -> list[Path]:
    if not getattr(cluster, "source", None):
        return []
    src = Path(cluster.source).expanduser().resolve()
    keyed = hashlib.sha256(str(src).encode()).hexdigest()[:12]
    cache = Path(os.path.expanduser("~/.cache/vpscluster"))
    return [src.parent / ".vpscluster" / f"{src.stem}.{kind}.json", cache / f"{src.stem}-{keyed}.{kind}.json"]


def save(cluster, kind: str, doc: dict, what: str) -> Path:
    """Write `doc` to the first candidate that takes it; OSError naming them all (`what`: "the
    overlay") when none does."""
    paths = candidates(cluster, kind)
    last: OSError | None = None
    for p in paths:
        try:
            p.parent.mkdir(parents=True, exist_ok=True)
            fsutil.write_json(p, doc)
            return p
        except OSError as e:
            last = e
    raise OSError(f"cannot record {what} in {', '.join(map(str, paths))}: {last}")
