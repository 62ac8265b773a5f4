"""The cluster's encrypted overlay (WireGuard mesh), as `vpscluster provision` left it.

Provisioning the overlay role records, on this machine, which private address and interface each
node got (`<cluster file dir>/.vpscluster/<stem>.overlay.json`, falling back to
`~/.cache/vpscluster/`), with a fingerprint of the nodes it was made for. Launches read it back:

    load(cluster)  -> Overlay | None   (None: no overlay, or one made for other nodes)
    save(cluster, interface, addresses, subnet)
    forget(cluster)

With an overlay, `train`, `run` and `batch` bind to the overlay addresses and name its interface
to gloo/NCCL (launch/preflight.py `node_endpoint` decides, one place for all of them), so
training traffic crosses the underlay only inside WireGuard; without one, nothing changes.
The record is only what was set up: pre-flight checks on each node that the interface really
carries the address before anything starts.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

from vpscluster import fsutil

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
    """The nodes the overlay was made for: names, underlay hosts, SSH ports."""
    nodes = sorted((n.name, n.host, n.port) for n in cluster.nodes)
    return hashlib.sha256(json.dumps(nodes).encode()).hexdigest()[:16]


def _candidates(cluster) -> list[Path]:
    if not getattr(cluster, "source", None):
        return []  # the local cluster has no overlay
    src = Path(cluster.source).expanduser().resolve()
    keyed = hashlib.sha256(str(src).encode()).hexdigest()[:12]
    cache = Path(os.path.expanduser("~/.cache/vpscluster"))
    return [src.parent / ".vpscluster" / f"{src.stem}.overlay.json", cache / f"{src.stem}-{keyed}.overlay.json"]


def load(cluster) -> Overlay | None:
    """The overlay provisioned for exactly these nodes, or None."""
    if getattr(cluster, "is_local", False):
        return None
    want = fingerprint(cluster)
    for p in _candidates(cluster):
        try:
            doc = json.loads(p.read_text())
        except (OSError, ValueError):
            continue
        if not isinstance(doc, dict) or doc.get("fingerprint") != want:
            continue
        addresses = {str(k): str(v) for k, v in (doc.get("addresses") or {}).items()}
        if any(n.name not in addresses for n in cluster.nodes):
            continue
        return Overlay(interface=str(doc.get("interface") or DEFAULT_INTERFACE), subnet=str(doc.get("subnet", "")),
                       addresses=addresses, provisioned_at_unix=float(doc.get("provisioned_at_unix", 0)), path=str(p))
    return None


def save(cluster, interface: str, addresses: dict[str, str], subnet: str) -> Path:
    doc = {"fingerprint": fingerprint(cluster), "interface": interface, "subnet": subnet,
           "addresses": dict(addresses), "provisioned_at_unix": time.time()}
    candidates = _candidates(cluster)
    last: OSError | None = None
    for p in candidates:
        try:
            p.parent.mkdir(parents=True, exist_ok=True)
            fsutil.write_json(p, doc)
            return p
        except OSError as e:
            last = e
    raise OSError(f"cannot record the overlay in {', '.join(map(str, candidates))}: {last}")


def forget(cluster) -> None:
    for p in _candidates(cluster):
        try:
            p.unlink()
        except OSError:
            pass
