"""Where probe.json lives, so `plan` and `launch` find the last probe of a cluster.

A cluster file's probe is saved next to it, in `<dir>/.vpscluster/<file stem>.probe.json`
(falling back to `~/.cache/vpscluster/` when that folder is not writable); the local cluster's
in `~/.cache/vpscluster/local.probe.json`. Each probe carries the time it was taken and a
fingerprint of the nodes it measured (names, addresses, users, interpreters): a probe of a
cluster whose nodes changed since is not returned. A part of the cluster (the nodes that remain
after a failure, launch/recovery.py) gets the whole cluster's probe cut down to its nodes
(`restrict`): nothing about the nodes that remain changed, so there is nothing to probe again;
and a probe of a part never replaces a probe of the whole.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

from vpscluster import fsutil
from vpscluster.probe.problems import Thresholds, find_problems


def _cache_dir() -> Path:
    return Path(os.path.expanduser("~/.cache/vpscluster"))


def _key(n) -> list:
    return [n.name, n.host, n.port, n.user, n.python, n.local]


def fingerprint(cluster) -> str:
    nodes = sorted(tuple(_key(n)) for n in cluster.nodes)
    return hashlib.sha256(json.dumps(nodes).encode()).hexdigest()[:16]


def node_keys(cluster) -> dict[str, str]:
    """Per node, what the fingerprint covers, hashed: which nodes of a stored probe are still the same."""
    return {n.name: hashlib.sha256(json.dumps(_key(n)).encode()).hexdigest()[:16] for n in cluster.nodes}


def _part_of(probe: dict, cluster) -> bool:
    """True when every node of `cluster` is a node the probe measured, unchanged, and the probe
    measured more nodes (the cluster is a part of the probed one)."""
    stored = (probe.get("cluster") or {}).get("node_keys") or {}
    mine = node_keys(cluster)
    return isinstance(stored, dict) and len(stored) > len(mine) and all(stored.get(k) == v for k, v in mine.items())


def restrict(probe: dict, cluster) -> dict:
    """The probe as if it had measured only the nodes of `cluster` (a part of the probed one): their
    node records, the links between them, no sweep over other nodes, the problems found again for
    what is left; `cluster.part_of` says which probe it came from."""
    keep = {n.name for n in cluster.nodes}
    whole = probe.get("cluster") or {}
    out = dict(probe)
    out["cluster"] = {**whole, "head": cluster.head, "fingerprint": fingerprint(cluster),
                      "nodes": [n.name for n in cluster.nodes], "node_keys": node_keys(cluster),
                      "part_of": {"fingerprint": whole.get("fingerprint"), "nodes": whole.get("nodes")}}
    out["nodes"] = [n for n in probe.get("nodes", []) if n.get("name") in keep]
    for key in ("links", "overlay_links"):
        out[key] = [l for l in probe.get(key) or [] if l.get("src") in keep and l.get("dst") in keep]
    out["collectives"] = [c for c in probe.get("collectives") or [] if set(c.get("nodes") or ()) <= keep]
    if "regions" in probe:  # found again among the nodes left
        from vpscluster.probe.regions import probe_section

        out.update(probe_section(out, cluster))
    try:
        thresholds = Thresholds(**((probe.get("settings") or {}).get("thresholds") or {}))
    except TypeError:
        thresholds = Thresholds()
    out["problems"] = find_problems(out, thresholds)
    return out


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
    """Save it where `load_probe` looks, unless a probe of the whole cluster is there and this
    cluster is a part of it (the whole one stays: it serves the part too)."""
    path = probe_path(cluster)
    try:
        stored = json.loads(path.read_text())
    except (OSError, ValueError):
        stored = None
    if isinstance(stored, dict) and _part_of(stored, cluster):
        return path
    write_json(path, probe)
    return path


def load_probe(cluster, max_age_s: float | None = None) -> dict | None:
    """The last probe of this cluster (or of the cluster it is a part of, `restrict`ed to its
    nodes), or None if there is none, it is older than `max_age_s`, or the cluster's nodes changed
    since."""
    for p in _candidates(cluster):
        try:
            probe = json.loads(p.read_text())
        except (OSError, ValueError):
            continue
        meta = probe.get("cluster", {}) if isinstance(probe, dict) else {}
        whole = meta.get("fingerprint") == fingerprint(cluster)
        if not whole and not _part_of(probe, cluster):
            continue
        if max_age_s is not None and time.time() - float(probe.get("probed_at_unix", 0)) > max_age_s:
            continue
        return probe if whole else restrict(probe, cluster)
    return None
