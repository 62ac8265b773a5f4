"""Throwaway OpenSSH servers on 127.0.0.1 for the cluster tests (root only).

Each `SSHDNode` is a real `/usr/sbin/sshd -D -e -f CONFIG` on a free loopback port with its own
generated ed25519 host key; one generated client key is authorised on all of them. Nothing
outside the temporary folder is touched except /run/sshd (sshd's privilege-separation folder).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from vpscluster.nodeside.free_port import free_port

SSHD = "/usr/sbin/sshd"


def sshd_unavailable_reason() -> str | None:
    if os.geteuid() != 0:
        return "needs root to run a throwaway sshd"
    if not os.path.exists(SSHD) or not shutil.which("ssh-keygen"):
        return "needs openssh-server and ssh-keygen (apt-get install openssh-server openssh-client)"
    return None


def keygen(path: Path) -> None:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "", "-f", str(path)], check=True)


@dataclass
class SSHDNode:
    name: str
    port: int
    host_key: Path
    proc: subprocess.Popen | None = None

    def known_hosts_line(self) -> str:
        algorithm, blob = self.host_key.with_suffix(".pub").read_text().split()[:2]
        return f"[127.0.0.1]:{self.port} {algorithm} {blob}\n"


class SSHDFarm:
    """`count` sshd processes sharing one client key; `stop()` ends them all."""

    def __init__(self, root: Path, count: int) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        os.makedirs("/run/sshd", mode=0o755, exist_ok=True)
        self.client_key = root / "id_ed25519"
        keygen(self.client_key)
        (root / "authorized_keys").write_text(self.client_key.with_suffix(".pub").read_text())
        self.nodes: list[SSHDNode] = []
        for i in range(count):
            key = root / f"host{i}_ed25519"
            keygen(key)
            node = SSHDNode(name=f"node-{chr(ord('a') + i)}", port=free_port(), host_key=key)
            self._start(node)
            self.nodes.append(node)
        for node in self.nodes:
            self._wait_listening(node)

    def _start(self, node: SSHDNode) -> None:
        config = self.root / f"sshd_{node.name}.conf"
        config.write_text("\n".join([
            f"Port {node.port}", "ListenAddress 127.0.0.1", f"HostKey {node.host_key}",
            f"PidFile {self.root}/sshd_{node.name}.pid", f"AuthorizedKeysFile {self.root}/authorized_keys",
            "UsePAM no", "StrictModes no", "PasswordAuthentication no", "KbdInteractiveAuthentication no",
            "PermitRootLogin prohibit-password", "Subsystem sftp internal-sftp", "LogLevel ERROR",
            "",  # MaxSessions stays at OpenSSH's default (10), as on a real server
        ]))
        log = open(self.root / f"sshd_{node.name}.log", "ab")
        node.proc = subprocess.Popen([SSHD, "-D", "-e", "-f", str(config)], stdout=log, stderr=log)

    def _wait_listening(self, node: SSHDNode, timeout_s: float = 10.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if node.proc.poll() is not None:
                raise RuntimeError(f"sshd for {node.name} exited: {(self.root / f'sshd_{node.name}.log').read_text()}")
            try:
                socket.create_connection(("127.0.0.1", node.port), timeout=0.5).close()
                return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(f"sshd for {node.name} did not listen on {node.port} within {timeout_s} s")

    def replace_host_key(self, index: int) -> None:
        """Restart node `index` with a fresh host key (what a reinstalled server or an attacker shows)."""
        node = self.nodes[index]
        node.proc.terminate()
        node.proc.wait(10)
        for path in (node.host_key, node.host_key.with_suffix(".pub")):
            path.unlink()
        keygen(node.host_key)
        self._start(node)
        self._wait_listening(node)

    def known_hosts(self, path: Path, nodes: list[SSHDNode] | None = None) -> Path:
        path.write_text("".join(n.known_hosts_line() for n in (nodes if nodes is not None else self.nodes)))
        return path

    def cluster_yaml(self, path: Path, known_hosts: Path, extra_nodes: list[dict] | None = None, **top) -> Path:
        import yaml

        nodes = [{"name": n.name, "host": "127.0.0.1", "port": n.port} for n in self.nodes] + (extra_nodes or [])
        doc = {"known_hosts": str(known_hosts), **top,
               "defaults": {"user": "root", "identity_file": str(self.client_key)}, "nodes": nodes}
        path.write_text(yaml.safe_dump(doc, sort_keys=False))
        return path

    def stop(self) -> None:
        for node in self.nodes:
            if node.proc and node.proc.poll() is None:
                node.proc.terminate()
                try:
                    node.proc.wait(10)
                except subprocess.TimeoutExpired:
                    node.proc.kill()
                    node.proc.wait(10)
