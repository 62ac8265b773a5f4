"""The cluster.yaml a sandbox writes for itself (the format `vpscluster.cluster.inventory` loads).

Paths are absolute, `python` is the interpreter running vpscluster (the filesystem is shared
with the nodes; own-root nodes are lent its folders where they would not see them, rootfs.py)
and each node has its own workdir in the sandbox's state directory, so code
sync and run directories are as real as on separate machines.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vpscluster.cluster.sandbox.state import SandboxInfo

CONNECT_TIMEOUT_S = 10
COMMAND_TIMEOUT_S = 60


def format_rate(mbit: float) -> str:
    """100.0 -> '100mbit', 1000.0 -> '1gbit', 2.5 -> '2500kbit' (tc spelling, exact)."""
    if mbit >= 1000 and float(mbit / 1000).is_integer():
        return f"{int(mbit // 1000)}gbit"
    if float(mbit).is_integer():
        return f"{int(mbit)}mbit"
    return f"{int(round(mbit * 1000))}kbit"


def cluster_document(info: "SandboxInfo") -> dict:
    return {
        "head": info.nodes[0].name,
        "known_hosts": info.known_hosts,
        "accept_new_host_keys": False,
        "connect_timeout_s": CONNECT_TIMEOUT_S,
        "command_timeout_s": COMMAND_TIMEOUT_S,
        "defaults": {"user": "root", "port": 22, "identity_file": info.identity_file, "python": sys.executable},
        "nodes": [
            {"name": n.name, "host": n.address, "workdir": n.workdir, "labels": {"sandbox": info.name, **({"region": n.region} if n.region else {})},
             "advertised_bandwidth": format_rate(n.bandwidth_mbit)}
            for n in info.nodes
        ],
    }


def write_cluster_file(info: "SandboxInfo") -> Path:
    import yaml

    path = Path(info.cluster_file)
    header = (f"# Written by `vpscluster sandbox up --name {info.name}`; removed by "
              f"`vpscluster sandbox down --name {info.name}`.\n")
    path.write_text(header + yaml.safe_dump(cluster_document(info), sort_keys=False, default_flow_style=False))
    return path
