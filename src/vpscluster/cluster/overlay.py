"""The cluster's encrypted overlay (WireGuard mesh), as `vpscluster provision` left it.

Provisioning the overlay role records, on this machine, which private address and interface each
node got (`<cluster file dir>/.vpscluster/<stem>.overlay.json`, falling back to
`~/.cache/vpscluster/`), with each node's identity: its name, underlay host and SSH port.
Launches read it back, node by node:

    load(cluster)  -> Overlay | None   (None: no overlay, or a node of `cluster` it was not made for)
    save(cluster, interface, addresses, subnet)
    forget(cluster)

With an overlay, `train`, `run` and `batch` bind to the overlay addresses and name its interface
to gloo/NCCL (launch/preflight.py `node_endpoint` decides, one place for all of them), so
training traffic crosses the underlay only inside WireGuard; without one, nothing changes.
The record is only what was set up: pre-flight checks on each node that the interface really
carries the address before anything starts.

The match is per node, so any subset of the provisioned nodes has the overlay (recovery's
relaunch on the survivors, launch/recovery.py `subset`), while a node missing from the record,
or recorded with another host or port, has none, and neither has a cluster that holds it.
Records written before identities were kept per node carry only a fingerprint of the whole
node set: they match exactly that set, as they always did, and are rewritten with per-node
identities on that first match, so their subsets match from then on.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path

from vpscluster import fsutil
from vpscluster.cluster import records

DEFAULT_INTERFACE = "vpsc0"


@dataclass(frozen=True)
class Overlay:
    interface: str
    subnet: str
    addresses: dict[str, str]  # node name -> its overlay address
    provisioned_at_unix: float = 0.0
    path: str = ""

    def address(self, node: str) -> str | None:
        return self.addresses.get(node)

    def to_dict(self) -> dict:
        return {"interface": self.interface, "subnet": self.subnet, "addresses": dict(self.addresses),
                "provisioned_at_unix": self.provisioned_at_unix, "record": self.path}


def fingerprint(cluster) -> str:
    """The nodes the overlay was made for: names, underlay hosts, SSH ports (the whole set; kept in
    the record for readers that know only it)."""
    nodes = sorted((n.name, n.host, n.port) for n in cluster.nodes)
    return hashlib.sha256(json.dumps(nodes).encode()).hexdigest()[:16]


def identities(cluster) -> dict[str, dict]:
    """Per node, what makes it the node the overlay was made for: its underlay host and SSH port."""
    return {n.name: {"host": n.host, "port": n.port} for n in cluster.nodes}


def _candidates(cluster) -> list[Path]:
    return records.candidates(cluster, "overlay")


def load(cluster) -> Overlay | None:
    """The overlay of these nodes, when the record holds every one of them (same name, host and
    SSH port) with an address; None otherwise. `addresses` are those of `cluster`'s nodes."""
    if getattr(cluster, "is_local", False):
        return None
    want = identities(cluster)
    for p in _candidates(cluster):
        try:
            doc = json.loads(p.read_text())
        except (OSError, ValueError):
            continue
        if not isinstance(doc, dict):
            continue
        addresses = {str(k): str(v) for k, v in (doc.get("addresses") or {}).items()}
        recorded = doc.get("nodes")
        if not isinstance(recorded, dict):  # an older record: the whole set's fingerprint only
            if doc.get("fingerprint") != fingerprint(cluster):
                continue
            recorded = want
            _upgrade(p, doc, want)
        if any(n.name not in addresses or _identity(recorded.get(n.name)) != want[n.name] for n in cluster.nodes):
            continue
        return Overlay(interface=str(doc.get("interface") or DEFAULT_INTERFACE), subnet=str(doc.get("subnet", "")),
                       addresses={n.name: addresses[n.name] for n in cluster.nodes},
                       provisioned_at_unix=float(doc.get("provisioned_at_unix", 0)), path=str(p))
    return None


def _identity(recorded) -> dict | None:
    if not isinstance(recorded, dict):
        return None
    try:
        return {"host": str(recorded["host"]), "port": int(recorded["port"])}
    except (KeyError, TypeError, ValueError):
        return None


def _upgrade(path: Path, doc: dict, nodes: dict[str, dict]) -> None:
    """Write an older record's per-node identities, now known (it matched its whole node set)."""
    try:
        fsutil.write_json(path, {**doc, "nodes": nodes})
    except OSError:
        pass  # a read-only record still matches its whole set, as before


def save(cluster, interface: str, addresses: dict[str, str], subnet: str) -> Path:
    doc = {"fingerprint": fingerprint(cluster), "nodes": identities(cluster), "interface": interface, "subnet": subnet,
           "addresses": dict(addresses), "provisioned_at_unix": time.time()}
    return records.save(cluster, "overlay", doc, "the overlay")


def forget(cluster) -> None:
    for p in _candidates(cluster):
        try:
            p.unlink()
        except OSError:
            pass
