"""The executor interface: run things on a node, whatever the transport.

One small interface serves probe, launch, provision and Dask start-up alike. Two
implementations: `local.LocalExecutor` (processes on this machine) and `ssh.SSHExecutor`
(asyncssh, host keys verified, connections reused). All methods are async and every one takes
a timeout; nothing blocks forever.

An operation a backend cannot do raises `NotImplementedError` naming it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Awaitable, Callable, Mapping, Sequence

from vpscluster.cluster.node import Node

# Called with (stream, line) where stream is "stdout" or "stderr"; the line has no newline.
LineCallback = Callable[[str, str], None]


@dataclass
class CommandResult:
    node: str
    exit_status: int | None  # None when it timed out or the node was unreachable
    stdout: str = ""
    stderr: str = ""
    duration_s: float = 0.0
    timed_out: bool = False
    error: str | None = None  # one line: why it could not run (unreachable, auth, host key)

    @property
    def ok(self) -> bool:
        return self.exit_status == 0 and not self.timed_out and self.error is None


class ProcessHandle(ABC):
    """A process started in its own process group (session) on a node."""

    node: str

    @abstractmethod
    async def wait(self, timeout_s: float | None = None) -> int | None:
        """Exit status, or None if still running after `timeout_s`."""

    @abstractmethod
    async def stop(self, grace_s: float = 5.0) -> None:
        """SIGTERM the whole process group, SIGKILL after `grace_s`; safe to call twice."""

    @property
    @abstractmethod
    def returncode(self) -> int | None: ...


class Executor(ABC):
    """Runs commands on one node. Commands are shell strings or argv lists (quoted for the shell)."""

    node: Node

    @abstractmethod
    async def run(
        self,
        command: str | Sequence[str],
        timeout_s: float,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        input: str | bytes | None = None,
    ) -> CommandResult:
        """Run to completion; capture output. Never raises for a failing command or node: see `.error`."""

    @abstractmethod
    async def stream(
        self,
        command: str | Sequence[str],
        on_line: LineCallback,
        timeout_s: float | None,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
    ) -> CommandResult:
        """Run, calling `on_line` for each output line as it arrives."""

    @abstractmethod
    async def start(
        self,
        command: str | Sequence[str],
        on_line: LineCallback | None = None,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
    ) -> ProcessHandle:
        """Start in its own process group and return at once; `stop()` ends it and its children."""

    @abstractmethod
    async def put(self, local_path: str, remote_path: str, timeout_s: float = 300.0) -> None:
        """Copy a file or a directory tree to the node (created parents; remote ~ expanded)."""

    @abstractmethod
    async def get(self, remote_path: str, local_path: str, timeout_s: float = 300.0) -> None:
        """Copy a file or a directory tree from the node to this machine."""

    async def close(self) -> None:
        """Close connections."""


async def fan_out(
    executors: Sequence[Executor], fn: Callable[[Executor], Awaitable["CommandResult"]]
) -> list["CommandResult"]:
    """Run `fn` on every executor in parallel; results in the executors' order."""
    import asyncio

    return list(await asyncio.gather(*(fn(ex) for ex in executors)))
