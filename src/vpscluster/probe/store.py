"""Where probe.json lives, so `plan` and `launch` find the last probe of a cluster.

A cluster file's probe is saved next to it, in `<dir>/.vpscluster/<file stem>.probe.json`
(falling back to `~/.cache/vpscluster/` when that folder is not writable); the local cluster's
in `~/.cache/vpscluster/local.probe.json`. Each probe carries the time it was taken and a
fingerprint of the nodes it measured (names, addresses, users, interpreters): a probe of a
cluster whose nodes changed since is not returned.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

from vpscluster import fsutil


def _cache_dir() -> Path:
    return Path(os.path.expanduser("~/.cache/vpscluster"))


def fingerprint(cluster) -> str:
    nodes = sorted((n.name, n.host, n.port, n.user, n.python, n.local) for n in cluster.nodes)
    return hashlib.sha256(json.dumps(nodes).encode()).hexdigest()[:16]


def _candidates(cluster) -> list[Path]:
    if not cluster.source:
        return [_cache_dir() / "local.probe.json"]
    src = Path(cluster.source).expanduser().resolve()
    keyed = hashlib.sha256(str(src).encode()).hexdigest()[:12]
    return [src.parent / ".vpscluster" / f"{src.stem}.probe.json", _cache_dir() / f"{src.stem}-{keyed}.probe.json"]


def probe_path(cluster) -> Path:
    """Where the probe of `cluster` is saved (the first writable candidate)."""
    for p in _candidates(cluster):
        try:
            p.parent.mkdir(parents=True, exist_ok=True)
            if os.access(p.parent, os.W_OK):
                return p
        except OSError:
            continue
    return _candidates(cluster)[-1]


def write_json(path: Path, doc: dict) -> None:
    """Write atomically: a reader never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fsutil.write_json(path, doc)


def save_probe(cluster, probe: dict) -> Path:
    path = probe_path(cluster)
    write_json(path, probe)
    return path


def load_probe(cluster, max_age_s: float | None = None) -> dict | None:
    """The last probe of this cluster, or None if there is none, it is older than `max_age_s`,
    or the cluster's nodes changed since."""
    for p in _candidates(cluster):
        try:
            probe = json.loads(p.read_text())
        except (OSError, ValueError):
            continue
        meta = probe.get("cluster", {}) if isinstance(probe, dict) else {}
        if meta.get("fingerprint") != fingerprint(cluster):
            continue
        if max_age_s is not None and time.time() - float(probe.get("probed_at_unix", 0)) > max_age_s:
            continue
        return probe
    return None
