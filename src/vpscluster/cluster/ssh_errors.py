"""One-line messages for SSH failures: what went wrong with which node, and what to do.

Messages name the node, address, user and key *file*; never key contents or passwords.
"""

from __future__ import annotations

import asyncio
import socket

from vpscluster.cluster.node import Node


def connect_error_message(node: Node, exc: BaseException, timeout_s: float) -> str:
    import asyncssh

    at = f"{node.name}: cannot connect to {node.host}:{node.port}"
    if isinstance(exc, (asyncio.TimeoutError, TimeoutError)):
        return f"{at}: timed out after {timeout_s:g} s"
    if isinstance(exc, ConnectionRefusedError):
        return f"{at}: connection refused; is sshd running there and is the port right?"
    if isinstance(exc, socket.gaierror):
        return f"{at}: cannot resolve host name {node.host!r}; fix the host in the cluster file"
    if isinstance(exc, asyncssh.PermissionDenied):
        key = f"the key {node.identity_file}" if node.identity_file else "the default keys (~/.ssh/id_*) and ssh-agent"
        return (f"{node.name}: {node.user}@{node.host}:{node.port} refused {key}; check user and identity_file, "
                "and that the public key is in the node's authorized_keys")
    if isinstance(exc, asyncssh.KeyImportError):
        # The library's message says what is wrong with the file (e.g. a passphrase is needed),
        # never what is in it.
        return (f"{node.name}: cannot load identity_file {node.identity_file}: {exc}; use a key without a "
                "passphrase, or load it into ssh-agent and leave identity_file out")
    if isinstance(exc, asyncssh.KeyExchangeFailed):
        return f"{at}: key exchange failed ({exc.reason}); the server's host key type may not match known_hosts"
    if isinstance(exc, asyncssh.DisconnectError):
        return f"{at}: {exc.reason}"
    if isinstance(exc, OSError):
        return f"{at}: {exc.strerror or exc}"
    return f"{at}: {type(exc).__name__}: {exc}"


def channel_error_message(node: Node, exc: BaseException) -> str:
    import asyncssh

    if isinstance(exc, asyncssh.ChannelOpenError):
        return (f"{node.name}: the server refused a new session ({exc.reason}); too many at once? "
                "raise MaxSessions in the node's sshd_config")
    if isinstance(exc, asyncssh.DisconnectError):
        return f"{node.name}: connection to {node.host}:{node.port} lost: {exc.reason}"
    if isinstance(exc, ValueError):
        return f"{node.name}: {exc}"
    return f"{node.name}: {type(exc).__name__}: {exc}"
