"""Records for where the nodes are and how to reach them (no I/O here)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Node:
    """One machine of the cluster, as the cluster file describes it."""

    name: str
    host: str  # the address by which the cluster reaches this node (never resolved by hostname on the node)
    port: int = 22
    user: str = "root"
    identity_file: str | None = None
    python: str = "python3"  # the interpreter to use on that node
    workdir: str = "~/vpscluster"  # where code, data and runs live on that node
    labels: dict[str, str] = field(default_factory=dict)
    advertised_bandwidth_mbit: float | None = None
    egress_quota_bytes: float | None = None
    egress_quota_period_s: float | None = None
    local: bool = False  # True: processes on this machine, no SSH

    def to_dict(self) -> dict[str, Any]:
        d = {
            "name": self.name, "host": self.host, "port": self.port, "user": self.user,
            "python": self.python, "workdir": self.workdir, "labels": dict(self.labels),
            "advertised_bandwidth_mbit": self.advertised_bandwidth_mbit,
            "egress_quota_bytes": self.egress_quota_bytes,
            "egress_quota_period_s": self.egress_quota_period_s, "local": self.local,
        }
        # identity_file is a path, not a secret, but keep reports free of key material paths too.
        return d


@dataclass(frozen=True)
class QueueServer:
    """A NATS server of the user's own, named by the cluster file's `queue:` (secrets stay in files)."""

    url: str
    token_file: str | None = None
    user: str | None = None
    password_file: str | None = None


@dataclass(frozen=True)
class Cluster:
    """The nodes, which one is the head, and how SSH trusts them."""

    nodes: tuple[Node, ...]
    head: str  # the name of the head node (rendezvous, Dask scheduler)
    source: str | None = None  # the cluster file, None for the local cluster
    known_hosts: str | None = None  # known_hosts file used to verify host keys
    accept_new_host_keys: bool = False  # trust on first use, recorded in known_hosts
    connect_timeout_s: float = 10.0
    command_timeout_s: float = 60.0
    dead_after_s: float = 20.0  # no answer at all (SSH keepalives included) this long: the node is gone
    firewall_allow: tuple[int, ...] = ()  # extra TCP ports every node opens to anyone (cluster file `firewall: {allow}`)
    firewall_ssh_from: tuple[str, ...] = ()  # where SSH may come from; empty: anywhere
    firewall_controller: tuple[str, ...] = ()  # the controller's addresses (SSH open to them); empty: SSH_CLIENT
    insecure_network: bool = False  # launch over public addresses anyway (see cluster/netsafety.py)
    queue: QueueServer | None = None  # the user's own NATS server (cluster file `queue:`); None: `queue up`'s

    @property
    def is_local(self) -> bool:
        return all(n.local for n in self.nodes)

    @property
    def head_node(self) -> Node:
        return next(n for n in self.nodes if n.name == self.head)

    def node(self, name: str) -> Node:
        for n in self.nodes:
            if n.name == name:
                return n
        raise KeyError(name)
