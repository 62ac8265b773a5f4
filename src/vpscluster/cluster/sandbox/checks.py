"""Checks that a freshly built sandbox works the way every other command will use it.

A real `ssh` login to each node with the generated key and known_hosts (strict host-key
checking), and TCP from each node to the next, which catches a host firewall dropping bridged
traffic (br_netfilter with a FORWARD policy of DROP) before any user command trips over it.
"""

from __future__ import annotations

import subprocess
import sys
from typing import TYPE_CHECKING

from vpscluster.cluster.executor import last_words
from vpscluster.errors import UserError

if TYPE_CHECKING:
    from vpscluster.cluster.sandbox.state import SandboxInfo, SandboxNode

CHECK_TIMEOUT_S = 10.0


def check_ssh(info: "SandboxInfo") -> None:
    """A real ssh login to every node with the generated key and known_hosts (strict checking)."""
    procs = {n.name: subprocess.Popen(ssh_command(info, n, "true"), stdin=subprocess.DEVNULL,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for n in info.nodes}
    _collect(procs, "ssh login from this machine")


def ssh_command(info: "SandboxInfo", node: "SandboxNode", command: str) -> list[str]:
    """`ssh` argv that logs in to a sandbox node the way the cluster file describes (for tests and debugging)."""
    return ["ssh", "-F", "/dev/null", "-i", info.identity_file, "-o", "IdentitiesOnly=yes",
            "-o", f"UserKnownHostsFile={info.known_hosts}", "-o", "StrictHostKeyChecking=yes",
            "-o", "BatchMode=yes", "-o", f"ConnectTimeout={int(CHECK_TIMEOUT_S)}", f"root@{node.address}", command]


def check_node_to_node(info: "SandboxInfo") -> None:
    """Each node opens TCP to the next one's sshd: bridged traffic is not dropped by a firewall."""
    if len(info.nodes) < 2:
        return
    procs = {}
    for i, n in enumerate(info.nodes):
        peer = info.nodes[(i + 1) % len(info.nodes)]
        code = f"import socket; socket.create_connection(({peer.address!r}, 22), {CHECK_TIMEOUT_S / 2}).close()"
        procs[f"{n.name} -> {peer.name}"] = subprocess.Popen(
            ["ip", "netns", "exec", n.namespace, sys.executable, "-S", "-c", code],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _collect(procs, "node-to-node TCP (if bridged traffic is filtered: sysctl net.bridge.bridge-nf-call-iptables=0 "
                    f"or allow forwarding on {info.bridge})")


def _collect(procs: dict[str, subprocess.Popen], what: str) -> None:
    failures = []
    for label, p in procs.items():
        try:
            _, err = p.communicate(timeout=CHECK_TIMEOUT_S + 5)
        except subprocess.TimeoutExpired:
            p.kill()
            p.communicate()
            failures.append(f"{label}: no answer within {CHECK_TIMEOUT_S + 5:.0f} s")
            continue
        if p.returncode != 0:
            failures.append(f"{label}: {last_words(err, None, p.returncode)}")
    if failures:
        raise UserError(f"sandbox: {what} failed: {'; '.join(failures)}")
