"""The cluster file (cluster.yaml): load, validate, and open executors for its nodes.

    head: node-a                 # optional; default: the first node
    known_hosts: known_hosts     # optional; default ~/.ssh/known_hosts
    accept_new_host_keys: false  # optional; trust on first use, recorded in known_hosts
    connect_timeout_s: 10        # optional
    command_timeout_s: 60        # optional
    defaults: {user: root, port: 22, identity_file: id_ed25519, python: ..., workdir: ...}
    nodes:
      - {name: node-a, host: 203.0.113.10, port: 22, user: root, identity_file: ~/.ssh/id_ed25519,
         python: /opt/venv/bin/python, workdir: /srv/vpscluster, labels: {region: fra},
         advertised_bandwidth: 1gbit, egress_quota: 20TB/month}

Every problem is one `UserError` line naming the file and the field, e.g.
"cluster.yaml: nodes[1].port: 70000 is not a port (1-65535)". Relative paths (identity files,
known_hosts) are relative to the file's folder; `~` expands. With no file, commands use
`local_cluster()`: one node, processes on this machine.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
from pathlib import Path
from typing import Any, AsyncIterator

from vpscluster.cluster.node import Cluster, Node
from vpscluster.errors import UserError

_TOP_KEYS = ("head", "known_hosts", "accept_new_host_keys", "connect_timeout_s", "command_timeout_s", "defaults", "nodes")
_NODE_KEYS = ("name", "host", "port", "user", "identity_file", "python", "workdir", "labels",
              "advertised_bandwidth", "egress_quota")
_DEFAULT_KEYS = tuple(k for k in _NODE_KEYS if k not in ("name", "host"))
# Names end up in log prefixes, file names and torchrun arguments: keep them plain.
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}")


def load_cluster(path: str | os.PathLike) -> Cluster:
    """Read and validate a cluster file; raise `UserError` on the first problem."""
    from vpscluster.config import load_yaml

    p = Path(path).expanduser()
    where = str(path)
    if not p.is_file():
        raise UserError(f"{where}: no such cluster file; pass --cluster with the path of your cluster.yaml")
    data = load_yaml(p, what="cluster file")
    return cluster_from_mapping(data, where, base_dir=p.resolve().parent)


def cluster_from_mapping(data: dict[str, Any], where: str, base_dir: Path) -> Cluster:
    """Validate the parsed YAML of a cluster file (`where` names it in messages)."""
    _check_keys(data, _TOP_KEYS, where)
    defaults = data.get("defaults") or {}
    if not isinstance(defaults, dict):
        raise UserError(f"{where}: defaults: expected a mapping of node fields, got {defaults!r}")
    _check_keys(defaults, _DEFAULT_KEYS, f"{where}: defaults")
    raw_nodes = data.get("nodes")
    if not isinstance(raw_nodes, list) or not raw_nodes:
        raise UserError(f"{where}: nodes: expected a list with at least one node (name, host)")

    nodes: list[Node] = []
    seen_names: dict[str, int] = {}
    seen_addrs: dict[tuple[str, int], int] = {}
    for i, raw in enumerate(raw_nodes):
        at = f"{where}: nodes[{i}]"
        if not isinstance(raw, dict):
            raise UserError(f"{at}: expected a mapping with at least name and host, got {raw!r}")
        _check_keys(raw, _NODE_KEYS, at)
        node = _build_node({**defaults, **raw}, at, base_dir)
        if node.name in seen_names:
            raise UserError(f"{at}.name: duplicate node name {node.name!r} (also nodes[{seen_names[node.name]}]); names must be unique")
        addr = (node.host.lower(), node.port)
        if addr in seen_addrs:
            raise UserError(f"{at}.host: duplicate address {node.host}:{node.port} (also nodes[{seen_addrs[addr]}]); "
                            "each node needs its own host:port")
        seen_names[node.name] = i
        seen_addrs[addr] = i
        nodes.append(node)

    head = data.get("head", nodes[0].name)
    if head not in seen_names:
        raise UserError(f"{where}: head: {head!r} is not a node; use one of {', '.join(seen_names)}")
    known_hosts = data.get("known_hosts")
    if known_hosts is None:
        known_hosts_path = Path("~/.ssh/known_hosts").expanduser()
    else:
        if not isinstance(known_hosts, str) or not known_hosts.strip():
            raise UserError(f"{where}: known_hosts: expected a file path, got {known_hosts!r}")
        known_hosts_path = _resolve(known_hosts, base_dir)
    return Cluster(
        nodes=tuple(nodes),
        head=str(head),
        source=where,
        known_hosts=str(known_hosts_path),
        accept_new_host_keys=_bool(data.get("accept_new_host_keys", False), f"{where}: accept_new_host_keys"),
        connect_timeout_s=_seconds(data.get("connect_timeout_s", 10.0), f"{where}: connect_timeout_s"),
        command_timeout_s=_seconds(data.get("command_timeout_s", 60.0), f"{where}: command_timeout_s"),
    )


def local_cluster() -> Cluster:
    """The one-node cluster of this machine: processes here, no SSH."""
    import getpass

    node = Node(name="local", host="127.0.0.1", local=True, python=sys.executable, workdir=os.getcwd(), user=getpass.getuser())
    return Cluster(nodes=(node,), head="local", source=None, known_hosts=None)


def executor_for(node: Node, cluster: Cluster):
    """The executor that reaches `node`: local processes or SSH."""
    if node.local:
        from vpscluster.cluster.local import LocalExecutor

        return LocalExecutor(node)
    from vpscluster.cluster.ssh import SSHExecutor

    return SSHExecutor(node, cluster)


@contextlib.asynccontextmanager
async def open_executors(cluster: Cluster) -> AsyncIterator[list]:
    """One executor per node (in the file's order), all closed at exit.

    SSH connections open on first use and are reused by every later call on that node.
    """
    executors = [executor_for(n, cluster) for n in cluster.nodes]
    try:
        yield executors
    finally:
        import asyncio

        await asyncio.gather(*(ex.close() for ex in executors), return_exceptions=True)


# --- field validation -------------------------------------------------------------------------


def _check_keys(mapping: dict, allowed: tuple[str, ...], at: str) -> None:
    for key in mapping:
        if key not in allowed:
            raise UserError(f"{at}: unknown key {key!r}; valid keys: {', '.join(allowed)}")


def _build_node(raw: dict[str, Any], at: str, base_dir: Path) -> Node:
    name = raw.get("name")
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
        raise UserError(f"{at}.name: {name!r} is not a node name; use letters, digits, '.', '_' or '-' (at most 63)")
    host = raw.get("host")
    if not isinstance(host, str) or not host.strip() or any(c.isspace() for c in host.strip()):
        raise UserError(f"{at}.host: {host!r} is not a host; give an IP address or DNS name")
    port = raw.get("port", 22)
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        raise UserError(f"{at}.port: {port!r} is not a port (1-65535)")
    user = raw.get("user", "root")
    if not isinstance(user, str) or not user or any(c.isspace() for c in user):
        raise UserError(f"{at}.user: {user!r} is not a user name")
    identity_file = raw.get("identity_file")
    if identity_file is not None:
        if not isinstance(identity_file, str) or not identity_file:
            raise UserError(f"{at}.identity_file: expected a file path, got {identity_file!r}")
        key_path = _resolve(identity_file, base_dir)
        if not key_path.is_file():
            raise UserError(f"{at}.identity_file: {key_path} does not exist; create the key (ssh-keygen -t ed25519) or fix the path")
        identity_file = str(key_path)
    labels = raw.get("labels") or {}
    if not isinstance(labels, dict) or any(isinstance(v, (dict, list)) for v in labels.values()):
        raise UserError(f"{at}.labels: expected a flat mapping like {{region: fra, provider: hetzner}}")
    bandwidth_mbit = quota_bytes = quota_period_s = None
    if raw.get("advertised_bandwidth") is not None:
        from vpscluster.units import parse_rate_mbit

        bandwidth_mbit = _reword(lambda: parse_rate_mbit(raw["advertised_bandwidth"], "advertised_bandwidth"), at)
    if raw.get("egress_quota") is not None:
        from vpscluster.units import parse_quota

        quota_bytes, quota_period_s = _reword(lambda: parse_quota(raw["egress_quota"], "egress_quota"), at)
    return Node(
        name=name,
        host=host.strip(),
        port=port,
        user=user,
        identity_file=identity_file,
        python=_text(raw.get("python", "python3"), f"{at}.python"),
        workdir=_text(raw.get("workdir", "~/vpscluster"), f"{at}.workdir"),
        labels={str(k): str(v) for k, v in labels.items()},
        advertised_bandwidth_mbit=bandwidth_mbit,
        egress_quota_bytes=quota_bytes,
        egress_quota_period_s=quota_period_s,
    )


def _reword(parse, at: str):
    """Units errors say 'advertised_bandwidth: ...'; prefix them with the file and node."""
    try:
        return parse()
    except UserError as e:
        raise UserError(f"{at}.{e}") from None


def _resolve(path: str, base_dir: Path) -> Path:
    p = Path(path).expanduser()
    return p if p.is_absolute() else (base_dir / p)


def _text(value: Any, at: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise UserError(f"{at}: expected a non-empty path, got {value!r}")
    return value.strip()


def _bool(value: Any, at: str) -> bool:
    if not isinstance(value, bool):
        raise UserError(f"{at}: expected true or false, got {value!r}")
    return value


def _seconds(value: Any, at: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise UserError(f"{at}: expected a positive number of seconds, got {value!r}")
    return float(value)
