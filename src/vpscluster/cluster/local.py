"""LocalExecutor: the executor interface on this machine, with asyncio subprocesses.

Every command runs through /bin/sh in a new session (`start_new_session=True`), so it leads
its own process group: a time-out or `stop()` signals the whole group (SIGTERM, then SIGKILL
after a grace period), children included. When a command's main process exits, whatever it
left running in its group is ended too: a command and everything it started are one unit
(a daemon that must outlive it has to leave the group itself, e.g. with `setsid`).
Standard input is /dev/null unless `run(input=...)` gives it.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import time
from pathlib import Path

from vpscluster.cluster.executor import (
    CappedText, CommandResult, Executor, LineCallback, LineSplitter, OutputTail, ProcessHandle, to_shell,
)
from vpscluster.cluster.node import Node
from vpscluster.errors import RemoteError

_READ_CHUNK = 65536


def group_alive(pgid: int) -> bool:
    """True while any non-zombie process is in group `pgid` (Linux /proc; kill(0) elsewhere)."""
    proc = Path("/proc")
    if not (proc / "self" / "stat").exists():
        try:
            os.killpg(pgid, 0)
            return True
        except (ProcessLookupError, PermissionError):
            return False
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # "pid (comm) state ppid pgrp ...": comm may hold spaces and parentheses.
        fields = stat[stat.rfind(")") + 2:].split()
        if len(fields) > 2 and fields[2] == str(pgid) and fields[0] != "Z":
            return True
    return False


async def end_group(pgid: int, grace_s: float) -> None:
    """SIGTERM the group, wait up to `grace_s` for it to go, then SIGKILL what is left."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 2.0)):
        try:
            os.killpg(pgid, sig)
        except (ProcessLookupError, PermissionError):
            return
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if not group_alive(pgid):
                return
            await asyncio.sleep(0.05)


async def _pump(reader: asyncio.StreamReader, stream: str, sinks: list, capture: CappedText | None = None) -> None:
    """Read `reader` to EOF into `capture`, handing each complete line to every sink(stream, line)."""
    splitter = LineSplitter()
    while True:
        data = await reader.read(_READ_CHUNK)
        if capture is not None:
            capture.add(data)
        lines = splitter.feed(data) if data else splitter.flush()
        for line in lines:
            for sink in sinks:
                sink(stream, line)
        if not data:
            return


class LocalProcess(ProcessHandle):
    """A process group started by `LocalExecutor.start`."""

    def __init__(self, node: str, proc: asyncio.subprocess.Process, on_line: LineCallback | None) -> None:
        self.node = node
        self.pgid = proc.pid  # a session leader's pid is its process group id
        self.output_tail = OutputTail()
        self._proc = proc
        sinks = [self.output_tail.add] + ([on_line] if on_line else [])
        self._pumps = asyncio.gather(_pump(proc.stdout, "stdout", sinks), _pump(proc.stderr, "stderr", sinks))
        self._done = asyncio.ensure_future(self._watch())

    async def _watch(self) -> int:
        await self._proc.wait()
        await end_group(self.pgid, grace_s=2.0)  # leftovers of a finished command
        try:
            await asyncio.wait_for(asyncio.shield(self._pumps), 5.0)
        except asyncio.TimeoutError:
            self._pumps.cancel()
        return self.returncode

    @property
    def returncode(self) -> int | None:
        return shell_status(self._proc.returncode)

    async def stop(self, grace_s: float = 5.0) -> None:
        if not self._done.done():
            await end_group(self.pgid, grace_s)
        await self.wait(grace_s + 5.0)


class LocalExecutor(Executor):
    """Runs commands on this machine."""

    def __init__(self, node: Node) -> None:
        self.node = node
        self._started: list[LocalProcess] = []

    async def _spawn(self, command, env, cwd, stdin) -> asyncio.subprocess.Process:
        full_env = {**os.environ, **{k: str(v) for k, v in (env or {}).items()}}
        workdir = os.path.expanduser(cwd) if cwd else None
        return await asyncio.create_subprocess_shell(
            to_shell(command), stdin=stdin, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            env=full_env, cwd=workdir, start_new_session=True,
        )

    async def run(self, command, timeout_s, env=None, cwd=None, input=None) -> CommandResult:
        return await self._execute(command, timeout_s, env, cwd, input, on_line=None)

    async def stream(self, command, on_line, timeout_s, env=None, cwd=None) -> CommandResult:
        return await self._execute(command, timeout_s, env, cwd, None, on_line=on_line)

    async def _execute(self, command, timeout_s, env, cwd, input, on_line) -> CommandResult:
        t0 = time.monotonic()
        stdin = asyncio.subprocess.PIPE if input is not None else asyncio.subprocess.DEVNULL
        try:
            proc = await self._spawn(command, env, cwd, stdin)
        except OSError as e:
            where = f" in {cwd}" if cwd else ""
            return CommandResult(self.node.name, None, duration_s=time.monotonic() - t0,
                                 error=f"{self.node.name}: cannot start the command{where}: {e.strerror}")
        out, err = CappedText(), CappedText()
        sinks = [on_line] if on_line else []
        pumps = asyncio.gather(_pump(proc.stdout, "stdout", sinks, out), _pump(proc.stderr, "stderr", sinks, err))
        timed_out = False

        async def finish() -> None:
            if input is not None:
                await _feed(proc, input)
            await proc.wait()
            await end_group(proc.pid, grace_s=2.0)  # leftovers keep the pipes open otherwise
            await asyncio.shield(pumps)  # a time-out must not throw away what was read

        try:
            await asyncio.wait_for(finish(), timeout_s)
        except asyncio.TimeoutError:
            timed_out = True
            await end_group(proc.pid, grace_s=2.0)
            await _settle(proc, pumps)
        except asyncio.CancelledError:
            pumps.cancel()
            await asyncio.shield(end_group(proc.pid, grace_s=1.0))
            raise
        return CommandResult(
            node=self.node.name, exit_status=None if timed_out else shell_status(proc.returncode),
            stdout=out.text(), stderr=err.text(), duration_s=time.monotonic() - t0, timed_out=timed_out,
        )

    async def start(self, command, on_line=None, env=None, cwd=None) -> LocalProcess:
        try:
            proc = await self._spawn(command, env, cwd, asyncio.subprocess.DEVNULL)
        except OSError as e:
            raise RemoteError(f"{self.node.name}: cannot start {to_shell(command)!r}: {e.strerror}") from None
        handle = LocalProcess(self.node.name, proc, on_line)
        self._started = [h for h in self._started if h.returncode is None] + [handle]
        return handle

    async def put(self, local_path: str, remote_path: str, timeout_s: float = 300.0) -> None:
        await self._copy(local_path, remote_path, timeout_s, "put")

    async def get(self, remote_path: str, local_path: str, timeout_s: float = 300.0) -> None:
        await self._copy(remote_path, local_path, timeout_s, "get")

    async def _copy(self, src: str, dst: str, timeout_s: float, verb: str) -> None:
        try:
            await asyncio.wait_for(asyncio.to_thread(copy_path, src, dst), timeout_s)
        except asyncio.TimeoutError:
            raise RemoteError(f"{self.node.name}: {verb} {src} -> {dst} timed out after {timeout_s:g} s") from None
        except OSError as e:
            raise RemoteError(f"{self.node.name}: {verb} {src} -> {dst} failed: {e.strerror or e}") from None

    async def close(self) -> None:
        # Nothing this executor started outlives it.
        await asyncio.gather(*(h.stop(grace_s=2.0) for h in self._started if h.returncode is None))


def shell_status(returncode: int | None) -> int | None:
    """Killed by signal N -> 128 + N, as a shell (and so the SSH executor) reports it."""
    return 128 - returncode if returncode is not None and returncode < 0 else returncode


def copy_path(src: str, dst: str) -> None:
    """Make `dst` a copy of file or tree `src` (parents created; a tree merges into `dst`)."""
    s, d = Path(src).expanduser(), Path(dst).expanduser()
    if not s.exists():
        raise FileNotFoundError(2, "no such file or directory", str(s))
    if d.exists() and s.resolve() == d.resolve():
        return  # same path: nothing to copy
    d.parent.mkdir(parents=True, exist_ok=True)
    if s.is_dir():
        shutil.copytree(s, d, symlinks=True, dirs_exist_ok=True)
    else:
        shutil.copy2(s, d)


async def _feed(proc: asyncio.subprocess.Process, data: str | bytes) -> None:
    try:
        proc.stdin.write(data.encode() if isinstance(data, str) else data)
        await proc.stdin.drain()
        proc.stdin.close()
    except (BrokenPipeError, ConnectionResetError):
        pass  # the command stopped reading; its exit status tells the rest


async def _settle(proc: asyncio.subprocess.Process, pumps: asyncio.Future) -> None:
    """After killing: reap the process and collect what the pipes still hold (bounded)."""
    try:
        await asyncio.wait_for(asyncio.gather(proc.wait(), pumps), 5.0)
    except asyncio.TimeoutError:
        pumps.cancel()
