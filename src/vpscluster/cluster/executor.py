"""The executor interface: run things on a node, whatever the transport.

One small interface serves probe, launch, provision and Dask start-up alike. Two
implementations: `local.LocalExecutor` (processes on this machine) and `ssh.SSHExecutor`
(asyncssh, host keys verified, connections reused). All methods are async and every one takes
a timeout; nothing blocks forever.

Semantics both implementations share (tests hold them to it):
- a command is a shell string, or an argv list quoted word by word (`to_shell`);
- `env` adds to (or overrides in) the node's environment; `cwd` may start with `~`;
- stdin is /dev/null unless `run(input=...)` gives data, so nothing waits for a terminal;
- every command leads its own process group: a time-out, `stop()` or Ctrl-C ends the group,
  children included; when the command's main process exits, what it left in its group is
  ended too (a daemon meant to outlive it must leave the group, e.g. with `setsid`);
- exit statuses are the shell's: killed by signal N reads 128 + N (SIGTERM -> 143);
- `run`/`stream` never raise for a failing command or node: `CommandResult.error` is one line
  naming the node and the fix; `start`/`put`/`get` raise `RemoteError` with such a line.

An operation a backend cannot do raises `NotImplementedError` naming it.
"""

from __future__ import annotations

import asyncio
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

    def reason(self) -> str:
        """One line saying why it did not succeed: the transport's error, the time-out, else
        the last line the command printed (stderr, else stdout), else its exit status."""
        if self.error:
            return self.error
        if self.timed_out:
            return f"timed out after {round(self.duration_s, 1):g} s"
        return last_words(self.stderr, self.stdout, self.exit_status)


def last_words(stderr: str | None, stdout: str | None = None, exit_status: int | None = None) -> str:
    """The last line a failed command printed (stderr, else stdout), else `exit status N`.

    The one-line reason for a failed `CommandResult` and for a local `subprocess` run alike.
    """
    lines = ((stderr or "").strip() or (stdout or "").strip()).splitlines()
    return lines[-1].strip() if lines else f"exit status {exit_status}"


class ProcessHandle(ABC):
    """A process started in its own process group (session) on a node.

    `output_tail` keeps the last lines it printed (stdout and stderr, interleaved), so a caller
    can show why it died without holding a whole training log in memory.
    """

    node: str
    pgid: int | None = None  # its process group on the node, once known
    output_tail: "OutputTail"
    error: str | None = None  # one line when it ended without an exit status (connection lost)
    _done: "asyncio.Future[int]"  # resolves to the exit status; each implementation watches it

    async def wait(self, timeout_s: float | None = None) -> int | None:
        """Exit status, or None if still running after `timeout_s` (255 if the connection was lost)."""
        try:
            return await asyncio.wait_for(asyncio.shield(self._done), timeout_s)
        except asyncio.TimeoutError:
            return None

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

    def note_hung(self, why: str) -> None:
        """The node's processes were found stopped (a frozen host, SIGSTOP): stopping a process
        started there waits no longer for an exit status it cannot send. Commands still run."""


def to_shell(command: str | Sequence[str]) -> str:
    """A shell command line: a string is used as written, an argv list is quoted word by word."""
    if isinstance(command, str):
        return command
    import shlex

    return shlex.join([str(c) for c in command])


class LineSplitter:
    """Bytes in, complete text lines out (no newline); the last partial line on `flush()`.

    Reads arrive in arbitrary chunks; lines may be far longer than asyncio's readline limit.
    """

    def __init__(self) -> None:
        self._buf = b""

    def feed(self, data: bytes) -> list[str]:
        self._buf += data
        if b"\n" not in data:
            return []
        *lines, self._buf = self._buf.split(b"\n")
        return [_decode(line) for line in lines]

    def flush(self) -> list[str]:
        rest, self._buf = self._buf, b""
        return [_decode(rest)] if rest else []


def _decode(line: bytes) -> str:
    return line.decode("utf-8", errors="replace").rstrip("\r")


class OutputTail:
    """The last `max_lines` lines (as "stream: line"), bounded in memory."""

    def __init__(self, max_lines: int = 200) -> None:
        import collections

        self.lines: "collections.deque[str]" = collections.deque(maxlen=max_lines)

    def add(self, stream: str, line: str) -> None:
        self.lines.append(line if stream == "stdout" else f"[{stream}] {line}")

    def text(self) -> str:
        return "\n".join(self.lines)


class CappedText:
    """Captured output, exactly as written (UTF-8 decoded incrementally), up to `max_chars`;
    beyond that only the newest `max_chars` are kept."""

    def __init__(self, max_chars: int = 4 << 20) -> None:
        import codecs

        self.max_chars = max_chars
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._parts: list[str] = []
        self._size = 0
        self.truncated = False

    def add(self, data: bytes) -> None:
        text = self._decoder.decode(data, final=not data)
        self._parts.append(text)
        self._size += len(text)
        if self._size > 2 * self.max_chars:  # amortised trimming
            text = "".join(self._parts)[-self.max_chars:]
            self._parts, self._size, self.truncated = [text], len(text), True

    def text(self) -> str:
        text = "".join(self._parts)
        return text[-self.max_chars:] if len(text) > self.max_chars else text


async def fan_out(
    executors: Sequence[Executor], fn: Callable[[Executor], Awaitable["CommandResult"]]
) -> list["CommandResult"]:
    """Run `fn` on every executor in parallel; results in the executors' order."""
    import asyncio

    return list(await asyncio.gather(*(fn(ex) for ex in executors)))
