"""The Ansible inventory for a cluster file: how to reach each node and what to set on it.

    {"all": {"children": {"cluster": {"hosts": {<node>: {ansible_host, ansible_port, ansible_user,
      ansible_ssh_private_key_file, firewall_peers, workdir, ...}}, "vars": {...}}}}}

Every string in it comes from the cluster file or this machine and is data, never a template:
`inventory_yaml` writes the file Ansible reads with each one tagged `!unsafe`, so a `workdir`
holding `{{ lookup('pipe', ...) }}` reaches the node as those characters and runs nothing on the
controller.

Host keys are checked as everywhere else in vpscluster: against the cluster's known_hosts only
(StrictHostKeyChecking=yes; `accept-new` when the cluster file says accept_new_host_keys,
which still refuses a changed key). Nothing in ~/.ssh/known_hosts or /etc/ssh is consulted
unless the cluster file names it.
"""

from __future__ import annotations

import ipaddress
import shlex
import socket
from typing import Any

from vpscluster.cluster.node import Cluster, Node
from vpscluster.cluster.overlay import DEFAULT_INTERFACE
from vpscluster.errors import UserError

OVERLAY_SUBNET = "10.77.0.0/24"  # the WireGuard mesh's private addresses, in node order
OVERLAY_PORT = 51820
OVERLAY_INTERFACE = DEFAULT_INTERFACE  # what launches bind to afterwards (cluster/overlay.py)
SEED_BUFFER_BYTES = 16 << 20  # the field's usual minimum for long fat links
MAX_BUFFER_BYTES = 256 << 20


def tcp_buffer_bytes(probe: dict | None) -> int:
    """Socket buffer size for the cluster: twice the largest measured bandwidth-delay product,
    rounded up to a power of two, at least 16 MB and at most 256 MB."""
    need = SEED_BUFFER_BYTES
    for link in (probe or {}).get("links", []) or []:
        try:
            bdp = float(link["bandwidth_mbit"]) * 1e6 / 8 * float(link["rtt_ms"]) / 1000
        except (KeyError, TypeError, ValueError):
            continue
        need = max(need, int(2 * bdp))
    size = 1 << (need - 1).bit_length()
    return min(max(size, SEED_BUFFER_BYTES), MAX_BUFFER_BYTES)


def node_address(node: Node) -> str:
    """The node's IP address as its peers see it (the cluster file's host, resolved here if a name)."""
    try:
        return str(ipaddress.ip_address(node.host))
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(node.host, None, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as e:
        raise UserError(f"provision: node {node.name}: cannot resolve host {node.host!r} ({e}); "
                        "write its IP address in the cluster file") from None
    return infos[0][4][0]


def ssh_args(cluster: Cluster) -> str:
    opts = [
        "-o", f"UserKnownHostsFile={cluster.known_hosts}",
        "-o", "GlobalKnownHostsFile=/dev/null",
        "-o", f"StrictHostKeyChecking={'accept-new' if cluster.accept_new_host_keys else 'yes'}",
        "-o", f"ConnectTimeout={max(1, int(round(cluster.connect_timeout_s)))}",
        "-o", "BatchMode=yes",
        "-o", "IdentitiesOnly=yes",
        "-o", "ServerAliveInterval=15",
    ]
    return " ".join(shlex.quote(o) for o in opts)


def overlay_addresses(cluster: Cluster) -> dict[str, str]:
    """Each node's private address on the WireGuard mesh, in the cluster file's node order."""
    subnet = ipaddress.ip_network(OVERLAY_SUBNET)
    if len(cluster.nodes) > subnet.num_addresses - 2:
        raise UserError(f"provision: {len(cluster.nodes)} nodes do not fit the overlay subnet {OVERLAY_SUBNET}")
    return {n.name: str(subnet.network_address + i + 1) for i, n in enumerate(cluster.nodes)}


def build_inventory(cluster: Cluster, extra_vars: dict[str, Any] | None = None) -> dict:
    if cluster.is_local or any(n.local for n in cluster.nodes):
        raise UserError("provision: the local cluster has nothing to provision; pass --cluster with a cluster file "
                        "(or a sandbox's: vpscluster sandbox up --own-root)")
    addresses = {n.name: node_address(n) for n in cluster.nodes}
    subnet = ipaddress.ip_network(OVERLAY_SUBNET)
    overlay = overlay_addresses(cluster)
    hosts: dict[str, dict] = {}
    for n in cluster.nodes:
        h: dict[str, Any] = {
            "ansible_host": n.host,
            "ansible_port": n.port,
            "ansible_user": n.user,
            "vpscluster_address": addresses[n.name],
            "vpscluster_workdir": n.workdir,
            # Peers by their underlay and their overlay address (traffic over the mesh comes from the latter).
            "firewall_peers": [a for name, a in addresses.items() if name != n.name]
                              + [a for name, a in overlay.items() if name != n.name],
            "overlay_address": overlay[n.name],
            "firewall_ssh_port": n.port,
        }
        if n.identity_file:
            h["ansible_ssh_private_key_file"] = n.identity_file
        if n.user != "root":
            h["ansible_become"] = True
        hosts[n.name] = h
    group_vars: dict[str, Any] = {
        "ansible_python_interpreter": "/usr/bin/python3",  # Debian/Ubuntu; override in the inventory
        "ansible_ssh_common_args": ssh_args(cluster),
        "firewall_allow": list(cluster.firewall_allow),
        "firewall_ssh_from": list(cluster.firewall_ssh_from),
        "firewall_controller": list(cluster.firewall_controller),
        "firewall_overlay_port": OVERLAY_PORT,
        "overlay_port": OVERLAY_PORT,
        "overlay_interface": OVERLAY_INTERFACE,
        "overlay_prefix": subnet.prefixlen,
        **(extra_vars or {}),
    }
    return {"all": {"children": {"cluster": {"hosts": hosts, "vars": group_vars}}}}


class _Unsafe(str):
    """A string Ansible must not template (written with the `!unsafe` tag)."""


def _mark_unsafe(value: Any) -> Any:
    if isinstance(value, str):
        return _Unsafe(value)
    if isinstance(value, dict):
        return {k: _mark_unsafe(v) for k, v in value.items()}  # keys (host and variable names) stay plain
    if isinstance(value, (list, tuple)):
        return [_mark_unsafe(v) for v in value]
    return value


def inventory_yaml(inventory: dict) -> str:
    """The inventory as the YAML file Ansible reads, every string value tagged `!unsafe`."""
    import yaml

    class Dumper(yaml.SafeDumper):
        pass

    Dumper.add_representer(_Unsafe, lambda d, v: d.represent_scalar("!unsafe", str(v)))
    return yaml.dump(_mark_unsafe(inventory), Dumper=Dumper, sort_keys=False, default_flow_style=False, width=1 << 16,
                     allow_unicode=True)
