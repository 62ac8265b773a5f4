"""The cluster file (cluster.yaml): load, validate, and open executors for its nodes.

    head: node-a                 # optional; default: the first node
    known_hosts: known_hosts     # optional; default ~/.ssh/known_hosts
    accept_new_host_keys: false  # optional; trust on first use, recorded in known_hosts
    connect_timeout_s: 10        # optional
    command_timeout_s: 60        # optional
    dead_after_s: 20             # optional; a node that answers nothing, not even SSH keepalives, this long is gone
    defaults: {user: root, port: 22, identity_file: id_ed25519, python: ..., workdir: ...}
    firewall: {allow: [5432, 9092], ssh_from: [198.51.100.0/24], controller: [203.0.113.7]}   # optional; see `vpscluster provision`
    insecure_network: false      # optional; true: launch over public addresses anyway (cluster/netsafety.py)
    queue: {url: nats://10.0.0.5:4222, token_file: nats.token}   # optional; a NATS server of your own
                                 # instead of `vpscluster queue up` (or user + password_file); see queue/server.py
    nodes:
      - {name: node-a, host: 203.0.113.10, port: 22, user: root, identity_file: ~/.ssh/id_ed25519,
         python: /opt/venv/bin/python, workdir: /srv/vpscluster, labels: {region: fra},
         advertised_bandwidth: 1gbit, egress_quota: 20TB/month}

pydantic checks the file against `ClusterFile` (every key's type and rule, unknown keys, rules
across nodes); every problem is one `UserError` line naming the file and the field, e.g.
"cluster.yaml: nodes[1].port: 70000 is not a port (1-65535)". Relative paths (identity files,
known_hosts) are relative to the file's folder; `~` expands. With no file, commands use
`local_cluster()`: one node, processes on this machine. After `vpscluster provision` (env), a
node's `python` is its provisioned venv's while the file's `python:` for it is unchanged
(cluster/venv.py).
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, AsyncIterator

from vpscluster.cluster.node import Cluster, Node, QueueServer
from vpscluster.config import PYDANTIC_CONFIG, Before, build, show
from vpscluster.errors import UserError

# Names end up in log prefixes, file names and torchrun arguments: keep them plain.
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}")
# Missing values are checked too (a node without a host is refused by the host's own rule).
_FILE_CONFIG = {**PYDANTIC_CONFIG, "validate_default": True}


def load_cluster(path: str | os.PathLike) -> Cluster:
    """Read and validate a cluster file; raise `UserError` (one line) on the first problem."""
    from vpscluster.config import load_yaml

    where = str(path)
    p = _expand(str(path), where)
    if p.is_dir():
        inside = sorted(q.name for q in p.glob("*.y*ml") if q.is_file())
        hint = f" (it holds {', '.join(inside[:3])})" if inside else ""
        raise UserError(f"{where} is a folder, not a cluster file{hint}; pass --cluster with the path of the "
                        f"cluster.yaml itself, e.g. --cluster {os.path.join(where, inside[0] if inside else 'cluster.yaml')}")
    if not p.is_file():
        raise UserError(f"{where}: no such cluster file; pass --cluster with the path of your cluster.yaml")
    data = load_yaml(p, what="cluster file")
    from vpscluster.cluster import venv

    # Nodes provisioned with the env role run their venv (unless `python:` changed since: cluster/venv.py).
    return venv.apply(cluster_from_mapping(data, where, base_dir=p.resolve().parent))


def cluster_from_mapping(data: Any, where: str, base_dir: Path) -> Cluster:
    """Validate the parsed YAML of a cluster file (`where` names it in messages).

    pydantic checks every key and type against `ClusterFile` (rules across keys in its
    `__post_init__`); then each node's values are merged over `defaults` and files resolved.
    """
    spec = build(ClusterFile, data, where)
    nodes = []
    for i, entry in enumerate(spec.nodes):
        given = {k: v for k, v in vars(spec.defaults).items() if v is not None}
        given.update({k: v for k, v in vars(entry).items() if v is not None})
        identity_file = given.pop("identity_file", None)
        if identity_file is not None:
            key_path = _resolve(identity_file, base_dir, f"{where}: nodes[{i}].identity_file")
            if not key_path.is_file():
                raise UserError(f"{where}: nodes[{i}].identity_file: {key_path} does not exist; "
                                "create the key (ssh-keygen -t ed25519) or fix the path")
            given["identity_file"] = str(key_path)
        rate = given.pop("advertised_bandwidth", None)
        quota = given.pop("egress_quota", None)
        # Node's own defaults (port 22, user root, ...) fill what neither the node nor `defaults` set.
        nodes.append(Node(**given, advertised_bandwidth_mbit=rate,
                          egress_quota_bytes=quota[0] if quota else None,
                          egress_quota_period_s=quota[1] if quota else None))
    known_hosts = (Path("~/.ssh/known_hosts").expanduser() if spec.known_hosts is None
                   else _resolve(spec.known_hosts, base_dir, f"{where}: known_hosts"))
    return Cluster(
        nodes=tuple(nodes),
        head=spec.head or nodes[0].name,
        source=where,
        known_hosts=str(known_hosts),
        accept_new_host_keys=spec.accept_new_host_keys,
        connect_timeout_s=spec.connect_timeout_s,
        command_timeout_s=spec.command_timeout_s,
        dead_after_s=spec.dead_after_s,
        firewall_allow=tuple(spec.firewall.allow),
        firewall_ssh_from=tuple(spec.firewall.ssh_from),
        firewall_controller=tuple(spec.firewall.controller),
        insecure_network=spec.insecure_network,
        queue=_queue_server(spec.queue, base_dir, where),
    )


def _queue_server(q: "QueueSettings", base_dir: Path, where: str) -> QueueServer | None:
    if q.url is None:
        if q.token_file or q.user or q.password_file:
            raise UserError(f"{where}: queue: no url; write e.g. queue: {{url: nats://10.0.0.5:4222, token_file: nats.token}}")
        return None
    if q.token_file and (q.user or q.password_file):
        raise UserError(f"{where}: queue: give token_file or user and password_file, not both")
    if bool(q.user) != bool(q.password_file):
        raise UserError(f"{where}: queue: user and password_file go together")
    files = {}
    for key in ("token_file", "password_file"):
        value = getattr(q, key)
        if value is not None:
            path = _resolve(value, base_dir, f"{where}: queue.{key}")
            if not path.is_file():
                raise UserError(f"{where}: queue.{key}: {path} does not exist; write the secret there (mode 0600) or fix the path")
            files[key] = str(path)
    return QueueServer(url=q.url, user=q.user, **files)


# --- the file's schema: types and one-line rules per key (pydantic runs them) --------------------


def _name(value: Any) -> Any:
    if not isinstance(value, str) or not _NAME_RE.fullmatch(value):
        raise ValueError(f"{show(value)} is not a node name; use letters, digits, '.', '_' or '-' (at most 63)")
    return value


def _host(value: Any) -> Any:
    if not isinstance(value, str) or not value.strip() or any(c.isspace() for c in value.strip()):
        raise ValueError(f"{show(value)} is not a host; give an IP address or DNS name")
    return value.strip()


def _port(value: Any) -> Any:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 65535):
        raise ValueError(f"{show(value)} is not a port (1-65535)")
    return value


def _user(value: Any) -> Any:
    if value is not None and (not isinstance(value, str) or not value or any(c.isspace() for c in value)):
        raise ValueError(f"{show(value)} is not a user name")
    return value


def _path(value: Any) -> Any:
    if value is not None and (not isinstance(value, str) or not value.strip()):
        raise ValueError(f"expected a non-empty path, got {show(value)}")
    return value.strip() if isinstance(value, str) else value


def _labels(value: Any) -> Any:
    if value is None:
        return None
    if not isinstance(value, dict) or any(isinstance(v, (dict, list)) for v in value.values()):
        raise ValueError("expected a flat mapping like {region: fra, provider: hetzner}")
    return {str(k): str(v) for k, v in value.items()}


def _units(parse, what: str, example: str):
    """A units parser as a field rule: its message without the key (the path names it)."""

    def check(value: Any) -> Any:
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, (str, int, float)):
            raise ValueError(f"{show(value)} is not a {what}; write e.g. {example}")
        try:
            return parse(value)
        except UserError as e:
            raise ValueError(str(e).split(": ", 1)[-1]) from None

    check.__name__ = what
    return check


def _rate(value: Any) -> Any:
    from vpscluster.units import parse_rate_mbit

    return _units(parse_rate_mbit, "rate", "100mbit or 1gbit")(value)


def _quota(value: Any) -> Any:
    from vpscluster.units import parse_quota

    if value is not None and not isinstance(value, str):
        raise ValueError(f"{show(value)} is not a quota; write a size per day, week or month, e.g. 2TB/month")
    return _units(parse_quota, "quota", "2TB/month")(value)


def _flag(value: Any) -> Any:
    if not isinstance(value, bool):
        raise ValueError(f"expected true or false, got {show(value)}")
    return value


def _seconds(value: Any) -> Any:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
        raise ValueError(f"expected a positive number of seconds, got {show(value)}")
    return float(value)


def _dead_after(value: Any) -> Any:
    value = _seconds(value)
    if value < 4:
        raise ValueError(f"{show(value)} s is too short to tell a dead node from a busy link; use 4 or more")
    return value


def _known_hosts(value: Any) -> Any:
    if value is not None and (not isinstance(value, str) or not value.strip()):
        raise ValueError(f"expected a file path, got {show(value)}")
    return value


def _node_list(value: Any) -> Any:
    if not isinstance(value, list) or not value:
        raise ValueError("expected a list with at least one node (name, host)")
    return value


def _mapping_or_empty(value: Any) -> Any:
    return {} if value is None else value


def _nats_url(value: Any) -> Any:
    from urllib.parse import urlsplit

    if value is None:
        return None
    try:
        u = urlsplit(value) if isinstance(value, str) else None
        ok = u is not None and u.scheme in ("nats", "tls") and bool(u.hostname) and not u.username and (u.port or 4222) > 0
    except ValueError:
        ok = False
    if not ok:
        raise ValueError(f"{show(value)} is not a NATS server URL; write e.g. nats://10.0.0.5:4222 (tls://... for TLS), "
                         "credentials go in token_file or user + password_file")
    return value


def _allow_ports(value: Any) -> Any:
    if value is None:
        return []
    if not isinstance(value, list):
        raise ValueError(f"{show(value)} is not a list of ports; write e.g. [5432, 9092]")
    for v in value:
        _port(v)
    return sorted(set(value))


def _sources(value: Any) -> Any:
    import ipaddress

    if value is None:
        return []
    if not isinstance(value, list):
        raise ValueError(f"{show(value)} is not a list of addresses; write e.g. [198.51.100.7, 203.0.113.0/24]")
    out = []
    for v in value:
        try:
            out.append(str(ipaddress.ip_network(str(v), strict=False)))
        except ValueError:
            raise ValueError(f"{show(v)} is not an IP address or network (e.g. 203.0.113.0/24)") from None
    return out


@dataclass
class FirewallSettings:
    """`firewall:` of the cluster file, for `vpscluster provision` (nftables on every node)."""

    __pydantic_config__ = _FILE_CONFIG
    allow: Annotated[list[int], Before(_allow_ports)] = field(default_factory=list)  # TCP ports open to anyone
    ssh_from: Annotated[list[str], Before(_sources)] = field(default_factory=list)  # SSH sources; empty: anywhere
    # Where this machine (the controller) connects from; SSH is always open to it. Unset: each
    # node's SSH_CLIENT, and only when ssh_from limits SSH (said in provision's report).
    controller: Annotated[list[str], Before(_sources)] = field(default_factory=list)


@dataclass
class QueueSettings:
    """`queue:` of the cluster file: a NATS JetStream server of the user's own (else `vpscluster queue up`)."""

    __pydantic_config__ = _FILE_CONFIG
    url: Annotated[str | None, Before(_nats_url)] = None  # nats://HOST:PORT or tls://HOST:PORT
    token_file: Annotated[str | None, Before(_path)] = None  # a file holding the token (keep it 0600)
    user: Annotated[str | None, Before(_user)] = None
    password_file: Annotated[str | None, Before(_path)] = None


@dataclass
class NodeSettings:
    """What `defaults:` may set for every node (None: not set here)."""

    __pydantic_config__ = _FILE_CONFIG
    port: Annotated[int | None, Before(_port)] = None
    user: Annotated[str | None, Before(_user)] = None
    identity_file: Annotated[str | None, Before(_path)] = None
    python: Annotated[str | None, Before(_path)] = None  # the interpreter on that node
    workdir: Annotated[str | None, Before(_path)] = None
    labels: Annotated[dict[str, str] | None, Before(_labels)] = None
    advertised_bandwidth: Annotated[float | None, Before(_rate)] = None  # written 1gbit, held in Mbit/s
    egress_quota: Annotated[tuple[float, float] | None, Before(_quota)] = None  # written 20TB/month: (bytes, period s)


@dataclass
class NodeEntry(NodeSettings):
    """One entry of `nodes:`: a name and a host, and any of the defaults' keys."""

    name: Annotated[str | None, Before(_name)] = None
    host: Annotated[str | None, Before(_host)] = None


@dataclass
class ClusterFile:
    """The whole cluster file."""

    __pydantic_config__ = _FILE_CONFIG
    head: Annotated[str | None, Before(lambda v: v if v is None else _name(v))] = None  # default: the first node
    known_hosts: Annotated[str | None, Before(_known_hosts)] = None  # default ~/.ssh/known_hosts
    accept_new_host_keys: Annotated[bool, Before(_flag)] = False  # trust on first use
    connect_timeout_s: Annotated[float, Before(_seconds)] = 10.0
    command_timeout_s: Annotated[float, Before(_seconds)] = 60.0
    dead_after_s: Annotated[float, Before(_dead_after)] = 20.0
    defaults: Annotated[NodeSettings, Before(_mapping_or_empty)] = field(default_factory=NodeSettings)
    nodes: Annotated[list[NodeEntry], Before(_node_list)] = field(default_factory=list)
    firewall: Annotated[FirewallSettings, Before(_mapping_or_empty)] = field(default_factory=FirewallSettings)
    insecure_network: Annotated[bool, Before(_flag)] = False  # launch over public addresses (no overlay) anyway
    queue: Annotated[QueueSettings, Before(_mapping_or_empty)] = field(default_factory=QueueSettings)

    def __post_init__(self) -> None:
        """Rules across nodes; ValueError so that pydantic reports them like any other key."""
        names: dict[str, int] = {}
        addrs: dict[tuple[str, int], int] = {}
        port = self.defaults.port or Node.__dataclass_fields__["port"].default
        for i, n in enumerate(self.nodes):
            if n.name in names:
                raise ValueError(f"nodes[{i}].name: duplicate node name {show(n.name)} (also nodes[{names[n.name]}]); "
                                 "names must be unique")
            addr = (str(n.host).lower(), n.port or port)
            if addr in addrs:
                raise ValueError(f"nodes[{i}].host: duplicate address {n.host}:{addr[1]} (also nodes[{addrs[addr]}]); "
                                 "each node needs its own host:port")
            names[str(n.name)] = i
            addrs[addr] = i
        if self.head is not None and self.head not in names:
            raise ValueError(f"head: {show(self.head)} is not a node; use one of {', '.join(names)}")


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


def _resolve(path: str, base_dir: Path, at: str) -> Path:
    p = _expand(path, at)
    return p if p.is_absolute() else (base_dir / p)


def _expand(path: str, at: str) -> Path:
    try:
        return Path(path).expanduser()
    except RuntimeError:  # `~name/...` for a user this machine does not know
        raise UserError(f"{at}: {path}: no home folder for that user here; write the full path") from None
