"""The interpreter each node runs, as `vpscluster provision` (the env role) left it.

The env role builds a venv on every node (`<workdir>/venv`, vpscluster's whole run-time closure).
Provisioning records, on this machine, each node's venv interpreter next to the cluster file
(`<cluster file dir>/.vpscluster/<stem>.venv.json`, falling back to `~/.cache/vpscluster/`, as
the overlay record is kept), with the `python:` the cluster file gave that node at the time.
`load_cluster` applies it, node by node, so every command (train, run, batch, probe, exec)
runs on the provisioned venv without the cluster file being edited:

- a node whose `python:` in the cluster file is still the one it had when it was provisioned
  runs the venv;
- a `python:` the user wrote after provisioning wins: it was chosen on purpose, after the fact;
- a node the record does not know (another name, host or SSH port) keeps its `python:`.

    apply(cluster) -> Cluster             (nodes' `python` replaced where the record says)
    save(cluster, pythons) -> Path        (pythons: node name -> its venv interpreter)
    load(cluster) -> dict | None          (the record's nodes, as written)
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Any

from vpscluster.cluster import records


def _candidates(cluster) -> list[Path]:
    return records.candidates(cluster, "venv")


def load(cluster) -> dict[str, Any] | None:
    """The record of this cluster file ({"nodes": {name: {...}}, "record": path}), or None."""
    for p in _candidates(cluster):
        try:
            doc = json.loads(p.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(doc, dict) and isinstance(doc.get("nodes"), dict):
            return {**doc, "record": str(p)}
    return None


def apply(cluster):
    """`cluster` with each recorded node's `python` set to its provisioned venv (see the module)."""
    doc = load(cluster)
    if doc is None:
        return cluster
    nodes = []
    for n in cluster.nodes:
        rec = doc["nodes"].get(n.name)
        if (isinstance(rec, dict) and rec.get("host") == n.host and rec.get("port") == n.port
                and rec.get("file_python") == n.python and isinstance(rec.get("python"), str)):
            n = dataclasses.replace(n, python=rec["python"])
        nodes.append(n)
    return dataclasses.replace(cluster, nodes=tuple(nodes))


def save(cluster, pythons: dict[str, str]) -> Path:
    """Record `pythons` (node name -> venv interpreter) for these nodes, keeping other nodes' entries."""
    old = load(cluster) or {"nodes": {}}
    entries = {k: v for k, v in old["nodes"].items() if isinstance(v, dict)}
    for n in cluster.nodes:
        if n.name not in pythons:
            continue
        prev = entries.get(n.name) or {}
        # A node already running its recorded venv (applied at load) keeps the file's own `python:`.
        file_python = prev.get("file_python") if prev.get("python") == n.python and prev.get("file_python") else n.python
        entries[n.name] = {"host": n.host, "port": n.port, "python": pythons[n.name], "file_python": file_python,
                           "provisioned_at_unix": time.time()}
    doc = {"nodes": entries}
    return records.save(cluster, "venv", doc, "the provisioned venvs")
