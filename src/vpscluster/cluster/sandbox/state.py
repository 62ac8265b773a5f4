"""What a sandbox is made of, where it is recorded, and how its names are derived.

Every kernel object of a sandbox is named from the sandbox name, so `down` finds everything
even after an `up` that died half-way (before or after the state file was written):

    network namespace   vpsc.<name>.<node>                  (e.g. vpsc.default.node-1)
    bridge              vpsbr<tag>                          (tag: 6 hex digits of sha1(name))
    host-side veth      vps<tag>n<i>                        (node end vpp<tag>n<i>, renamed eth0 inside)
    cgroup (cpu)        <root>/vpscluster/<name>/<node>        (v1: /sys/fs/cgroup/cpu/..., v2: /sys/fs/cgroup/...)
    state directory     /var/lib/vpscluster/sandboxes/<name>   (keys, sshd configs, cluster.yaml, workdirs)

Interface names stay within the kernel's 15 characters. Each sandbox gets its own /24,
10.231.X.0/24, X derived from the name and moved on when another sandbox or route holds it.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import re
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Iterator

from vpscluster import fsutil
from vpscluster.errors import UserError

STATE_ROOT = Path("/var/lib/vpscluster/sandboxes")
NETNS_PREFIX = "vpsc."
BRIDGE_PREFIX = "vpsbr"
VETH_PREFIX = "vps"
PEER_PREFIX = "vpp"  # the node end of a veth, until it is moved into its namespace and renamed eth0
SUBNET_PREFIX = "10.231"
MAX_NODES = 60
NAME_RE = re.compile(r"[a-z0-9][a-z0-9-]{0,23}")


def check_name(name: str) -> str:
    if not NAME_RE.fullmatch(name or ""):
        raise UserError(
            f"sandbox: name {name!r} is not valid; use 1-24 lower-case letters, digits or '-', starting with a letter or digit"
        )
    return name


def tag(name: str) -> str:
    """6 hex digits naming the sandbox's links (interface names are limited to 15 characters)."""
    return hashlib.sha1(name.encode()).hexdigest()[:6]


def bridge_name(name: str) -> str:
    return f"{BRIDGE_PREFIX}{tag(name)}"


def veth_name(name: str, index: int) -> str:
    return f"{VETH_PREFIX}{tag(name)}n{index}"


def peer_name(name: str, index: int) -> str:
    return f"{PEER_PREFIX}{tag(name)}n{index}"


def netns_name(name: str, node: str) -> str:
    return f"{NETNS_PREFIX}{name}.{node}"


def node_name(index: int) -> str:
    return f"node-{index}"


def state_dir(name: str) -> Path:
    return STATE_ROOT / name


def preferred_subnet_octet(name: str) -> int:
    """The third octet this name would like (1-254); `up` moves on when it is taken."""
    return int(hashlib.sha1(b"subnet:" + name.encode()).hexdigest(), 16) % 254 + 1


@dataclass
class SandboxNode:
    name: str
    address: str
    namespace: str
    bandwidth_mbit: float
    cpu: float | None  # share of one core; None: not limited
    veth: str  # host (bridge) side
    workdir: str
    cgroup: str | None = None
    region: str | None = None  # `up --regions`: written to the cluster file as labels.region


@dataclass
class SandboxInfo:
    name: str
    cluster_file: str
    nodes: list[SandboxNode]
    subnet: str
    bridge: str
    gateway: str  # the bridge's address in the root namespace (the launcher's side)
    state_dir: str
    latency_ms: float | None = None
    own_root: bool = False  # each node has its own filesystem (an overlay of the host's /; rootfs.py)
    identity_file: str = ""
    known_hosts: str = ""
    cgroup: str = ""  # the hierarchy limiting CPU: "v1" (cpu.cfs_quota_us) or "v2" (cpu.max)
    # Per-pair rates that differ from the ports: [{"src", "dst", "bandwidth_mbit"}] (links.py).
    links: list[dict] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """The `sandbox up --json` document: name, cluster_file, nodes[...] first, extras after."""
        nodes = [
            {"name": n.name, "address": n.address, "namespace": n.namespace, "bandwidth_mbit": n.bandwidth_mbit,
             "cpu": n.cpu, "veth": n.veth, "workdir": n.workdir, "cgroup": n.cgroup, "region": n.region}
            for n in self.nodes
        ]
        from vpscluster.cluster.sandbox.links import matrix
        return {"name": self.name, "cluster_file": self.cluster_file, "nodes": nodes, "subnet": self.subnet,
                "bridge": self.bridge, "gateway": self.gateway, "latency_ms": self.latency_ms,
                "state_dir": self.state_dir, "identity_file": self.identity_file, "known_hosts": self.known_hosts,
                "cgroup": self.cgroup or None, "links": matrix(self)}

    def node(self, name: str) -> SandboxNode:
        for n in self.nodes:
            if n.name == name:
                return n
        raise KeyError(name)


def save_info(info: SandboxInfo) -> None:
    fsutil.write_json(Path(info.state_dir) / "sandbox.json", asdict(info))


def load_info(name: str) -> SandboxInfo | None:
    path = state_dir(name) / "sandbox.json"
    try:
        raw = json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    # Keys this version does not know (a record written by a newer vpscluster) are left out,
    # so one machine's sandboxes stay readable across versions.
    raw["nodes"] = [SandboxNode(**_known(SandboxNode, n)) for n in raw["nodes"]]
    return SandboxInfo(**_known(SandboxInfo, raw))


def _known(cls, raw: dict[str, Any]) -> dict[str, Any]:
    names = {f.name for f in fields(cls)}
    return {k: v for k, v in raw.items() if k in names}


def known_names() -> list[str]:
    """Sandboxes with a state directory (complete or half-built)."""
    if not STATE_ROOT.is_dir():
        return []
    return sorted(p.name for p in STATE_ROOT.iterdir() if p.is_dir() and NAME_RE.fullmatch(p.name))


@contextmanager
def sandbox_lock(timeout_s: float = 120.0) -> Iterator[None]:
    """One `up`/`down` at a time on this machine, so two sandboxes never pick the same subnet."""
    import time

    STATE_ROOT.mkdir(parents=True, exist_ok=True)
    with open(STATE_ROOT / ".lock", "w") as f:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise UserError(f"sandbox: another `vpscluster sandbox` command held {STATE_ROOT / '.lock'} for {timeout_s:.0f} s; wait for it or remove stale sandboxes with `vpscluster sandbox down --all`") from None
                time.sleep(0.1)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def used_octets() -> set[int]:
    """Third octets of 10.231.X.0/24 held by recorded sandboxes or present as routes."""
    from vpscluster.cluster.sandbox.system import run_tool

    used: set[int] = set()
    for name in known_names():
        info = load_info(name)
        if info:
            used.add(int(info.subnet.split(".")[2]))
    routes = run_tool(["ip", "-4", "route", "show"], check=False).stdout
    for m in re.finditer(rf"\b{re.escape(SUBNET_PREFIX)}\.(\d+)\.", routes):
        used.add(int(m.group(1)))
    addrs = run_tool(["ip", "-4", "-o", "addr", "show"], check=False).stdout
    for m in re.finditer(rf"\b{re.escape(SUBNET_PREFIX)}\.(\d+)\.", addrs):
        used.add(int(m.group(1)))
    return used


def choose_subnet_octet(name: str) -> int:
    used = used_octets()
    start = preferred_subnet_octet(name)
    for k in range(254):
        octet = (start - 1 + k) % 254 + 1
        if octet not in used:
            return octet
    raise UserError(f"sandbox: every {SUBNET_PREFIX}.X.0/24 is taken; remove sandboxes with `vpscluster sandbox down --all`")
