"""SSHExecutor: the executor interface over SSH (asyncssh), one reused connection per node.

Host keys are checked against the cluster's known_hosts (see `known_hosts.py`). The user's
~/.ssh/config is not read: the cluster file is the one source of truth for how to reach a node.

Every command runs on the node inside a small POSIX-sh wrapper (`_WRAPPER`) that
- starts it under `setsid`, in its own session and process group, and prints that group's id
  first on stderr (a marker line this module strips), so `stop()` and time-outs can end the
  whole group with `kill -TERM -PGID` (then KILL) through a separate channel;
- keeps a watchdog on the channel's stdin: when the channel or the connection goes away (we
  never send EOF), the group is killed, so a dropped connection leaves no orphans;
- ends whatever the command left running in its group once it exits, as the local executor does.
The command's own stdin is /dev/null, unless `run(input=...)` passes data.

Connections: one per node, opened on first use, kept alive and reused by every call. A node
that sends nothing for a quarter of the cluster's `dead_after_s` gets an SSH keepalive; after
`dead_after_s` without any answer the connection is dropped as lost (so a cut link or a dead
host ends a launch's wait on it within that time, not at a TCP time-out). For the next
`dead_after_s` after such a loss, calls fail at once with that reason instead of each waiting out
a connect time-out (what a launch does after a failure — look for hung ranks, stop every process,
fetch files — would otherwise wait `connect_timeout_s` per step on a dead node); a node that
answers again is reached after that. Concurrent callers share one connect attempt and its
failure. At most 8 short commands hold a channel at once (OpenSSH allows 10 per connection by
default).

Errors never carry key material: messages name files, hosts and reasons only.
"""

from __future__ import annotations

import asyncio
import base64
import re
import shlex
import time
import uuid
from typing import Mapping

from vpscluster.cluster.executor import (
    CappedText, CommandResult, Executor, LineCallback, LineSplitter, OutputTail, ProcessHandle, to_shell,
)
from vpscluster.cluster.known_hosts import HostKeyCheck
from vpscluster.cluster.node import Cluster, Node
from vpscluster.errors import RemoteError

_MARKER = b"__VPSC_PGID__ "
# `alive`: is any process of the group running? Zombies do not count: an init that is slow to
# reap (as in containers) would otherwise stretch every grace period to its end.
_ALIVE = r"""alive() {
  if command -v ps >/dev/null 2>&1; then ps -e -o pgid= -o stat= | grep -q "^ *$1 [^Z]"
  else kill -0 -$1 2>/dev/null; fi
}
"""
_WRAPPER = _ALIVE + r"""exec 3<&0
setsid /bin/sh -c 'echo "__VPSC_PGID__ $$" >&2; exec /bin/sh -c "$1"' vpscluster "$1" </dev/null 3<&- &
pid=$!
( cat <&3 >/dev/null; n=0
  until kill -TERM -$pid 2>/dev/null; do kill -0 $pid 2>/dev/null && [ $n -lt 50 ] || exit 0; sleep 0.1; n=$((n+1)); done
  i=0; while [ $i -lt 50 ] && alive $pid; do sleep 0.1; i=$((i+1)); done; kill -KILL -$pid ) >/dev/null 2>&1 &
exec 3<&-
wait $pid 2>/dev/null
st=$?
if kill -TERM -$pid 2>/dev/null; then
  i=0; while [ $i -lt 20 ] && alive $pid; do sleep 0.1; i=$((i+1)); done
  kill -KILL -$pid 2>/dev/null
fi
exit $st
"""
_INLINE_INPUT_MAX_BYTES = 48 * 1024  # one shell argument may hold 128 KiB; bigger input goes by SFTP
_READ_CHUNK = 65536
# OpenSSH's MaxSessions defaults to 10 channels per connection; short commands queue for 8 of
# them so that long-lived `start`ed processes and the kill channel always find room.
_MAX_SHORT_SESSIONS = 8
_KEEPALIVE_COUNT = 3  # unanswered keepalives tolerated; the next miss drops the connection
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def kill_group_command(pgid: int, grace_s: float) -> str:
    """Shell that TERMs group `pgid`, waits up to `grace_s` for it to go, then KILLs it."""
    ticks = max(1, int(grace_s * 10))
    return (f"{_ALIVE}kill -TERM -{pgid} 2>/dev/null || exit 0; i=0; "
            f"while [ $i -lt {ticks} ] && alive {pgid}; do sleep 0.1; i=$((i+1)); done; "
            f"kill -KILL -{pgid} 2>/dev/null; exit 0")


def remote_cd(cwd: str) -> str:
    """`cd` to `cwd` on the node, `~` meaning the remote home."""
    if cwd == "~":
        return 'cd "$HOME"'
    if cwd.startswith("~/"):
        return f'cd "$HOME"/{shlex.quote(cwd[2:])}'
    return f"cd {shlex.quote(cwd)}"


def wrap_command(command: str, env: Mapping[str, str] | None, cwd: str | None) -> str:
    """The full command line sent to sshd for `command` (see the module docstring)."""
    lines = []
    for name, value in (env or {}).items():
        if not _ENV_NAME.fullmatch(name):
            raise ValueError(f"not an environment variable name: {name!r}")
        lines.append(f"export {name}={shlex.quote(str(value))}")
    if cwd:
        lines.append(remote_cd(cwd) + " || exit 126")
    inner = "\n".join(lines + [command])
    return f"exec /bin/sh -c {shlex.quote(_WRAPPER)} vpscluster {shlex.quote(inner)}"


class _StderrFilter:
    """Removes the wrapper's process-group marker line from stderr and reports the id.

    The marker is normally the first line, but a login shell's start-up files may print before
    it, so it is looked for among the first `_SCAN_BYTES` of stderr; until it shows up, stderr
    is held back (a few milliseconds in practice).
    """

    _SCAN_BYTES = 8192

    def __init__(self, on_pgid) -> None:
        self._head = b""
        self._done = False
        self._on_pgid = on_pgid

    def feed(self, data: bytes) -> bytes:
        if self._done:
            return data
        self._head += data
        start = 0 if self._head.startswith(_MARKER) else self._head.find(b"\n" + _MARKER) + 1
        if start > 0 or self._head.startswith(_MARKER):
            end = self._head.find(b"\n", start)
            if end < 0 and data:
                return b""  # the marker line is not complete yet
            line = self._head[start:end if end >= 0 else len(self._head)]
            try:
                self._on_pgid(int(line[len(_MARKER):]))
            except ValueError:
                pass
            out = self._head[:start] + (self._head[end + 1:] if end >= 0 else b"")
        elif data and len(self._head) < self._SCAN_BYTES:
            return b""
        else:
            out = self._head  # no marker (e.g. setsid missing): pass everything through
        self._done, self._head = True, b""
        return out


async def _pump(reader, stream: str, sinks: list, capture: CappedText | None, filt: _StderrFilter | None) -> None:
    splitter = LineSplitter()
    while True:
        data = await reader.read(_READ_CHUNK)
        piece = filt.feed(data) if filt is not None else data
        if piece and capture is not None:
            capture.add(piece)
        lines = splitter.feed(piece) if data else splitter.feed(piece) + splitter.flush()
        for line in lines:
            for sink in sinks:
                sink(stream, line)
        if not data:
            if capture is not None:
                capture.add(b"")
            return


class SSHProcess(ProcessHandle):
    """A remote process group started by `SSHExecutor.start`."""

    def __init__(self, executor: "SSHExecutor", proc, on_line: LineCallback | None) -> None:
        self.node = executor.node.name
        self.pgid = None
        self.output_tail = OutputTail()
        self.error: str | None = None
        self._executor = executor
        self._proc = proc
        self._pgid_known = asyncio.Event()
        sinks = [self.output_tail.add] + ([on_line] if on_line else [])
        self._pumps = asyncio.gather(
            _pump(proc.stdout, "stdout", sinks, None, None),
            _pump(proc.stderr, "stderr", sinks, None, _StderrFilter(self._set_pgid)),
        )
        self._returncode: int | None = None
        self._done = asyncio.ensure_future(self._watch())

    def _set_pgid(self, pgid: int) -> None:
        self.pgid = pgid
        self._pgid_known.set()

    async def _watch(self) -> int:
        try:
            await asyncio.shield(self._pumps)
        except Exception:  # connection lost mid-read: the exit status below says so
            pass
        await self._proc.wait_closed()
        status = self._proc.exit_status
        if status is None or status < 0:
            # No exit status: the connection dropped (255, as ssh(1) reports it).
            self.error = self._executor.lost_reason() or f"{self.node}: the SSH channel closed without an exit status"
            status = 255
        self._returncode = status
        return status

    @property
    def returncode(self) -> int | None:
        return self._returncode

    async def stop(self, grace_s: float = 5.0) -> None:
        if self._done.done():
            return
        try:
            await asyncio.wait_for(self._pgid_known.wait(), 5.0)
        except asyncio.TimeoutError:
            pass
        if self.pgid is not None:
            await self._executor.kill_group(self.pgid, grace_s)
        self._proc.close()  # the wrapper's watchdog ends the group if the kill above could not
        # a dark or hung node sends no status: the kill above (or the watchdog) does the work
        await self.wait(1.0 if self._executor.dark() or self._executor.hung() else grace_s + 10.0)


class SSHExecutor(Executor):
    """Runs commands on one node over a single, reused SSH connection."""

    def __init__(self, node: Node, cluster: Cluster) -> None:
        self.node = node
        self.cluster = cluster
        self._conn = None
        self._sftp = None
        self._lost: str | None = None
        self._dark: str | None = None  # set when the node stopped answering (see _gone_dark)
        self._hung: str | None = None  # set when the launch found its processes stopped (note_hung)
        self._silent_until = 0.0  # time.monotonic() until which a node lost to silence is not retried
        self._lock = asyncio.Lock()
        self._attempts = 0  # connection attempts made, to share one failure among waiters
        self._last_error: str | None = None
        self._started: list[SSHProcess] = []
        self._sessions = asyncio.Semaphore(_MAX_SHORT_SESSIONS)

    @property
    def address(self) -> str:
        return f"{self.node.host}:{self.node.port}"

    def lost_reason(self) -> str | None:
        return self._lost

    def dark(self) -> bool:
        return self._dark is not None

    def hung(self) -> bool:
        return self._hung is not None

    def note_hung(self, why: str) -> None:
        self._hung = why

    async def connect(self):
        """The open connection, made on first use; raises RemoteError with a one-line reason."""
        if self._dark:
            raise RemoteError(self._dark)
        if time.monotonic() < self._silent_until and self._lost:
            raise RemoteError(self._lost)
        attempt = self._attempts
        async with self._lock:
            if self._conn is not None and not self._conn.is_closed():
                return self._conn
            if self._attempts != attempt and self._last_error:
                # Someone failed to connect while we waited: do not wait out another time-out.
                raise RemoteError(self._last_error)
            self._attempts += 1
            self._conn, self._sftp, self._lost = None, None, None
            try:
                self._conn = await self._open()
            except RemoteError as e:
                self._last_error = str(e)
                raise
            self._last_error = None
            return self._conn

    async def _open(self):
        import asyncssh

        from vpscluster.cluster.ssh_errors import connect_error_message

        check = HostKeyCheck(self.node.name, self.node.host, self.node.port,
                             self.cluster.known_hosts, self.cluster.accept_new_host_keys)
        executor = self

        class _Client(asyncssh.SSHClient):
            def validate_host_public_key(self, host, addr, port, key) -> bool:
                return check.decide(key)

            def connection_lost(self, exc) -> None:
                why = str(getattr(exc, "reason", None) or exc or "")
                executor._lost = f"{executor.node.name}: connection to {executor.address} lost" + (
                    f": {why}" if why else "")
                if "keepalive" in why:  # silent for dead_after_s: do not wait on it again soon
                    executor._lost += f" (nothing for {executor.cluster.dead_after_s:g} s)"
                    executor._silent_until = time.monotonic() + executor.cluster.dead_after_s

        timeout_s = self.cluster.connect_timeout_s
        try:
            conn = await asyncio.wait_for(asyncssh.connect(
                self.node.host, port=self.node.port, username=self.node.user,
                client_keys=[self.node.identity_file] if self.node.identity_file else (),
                known_hosts=check.matcher, client_factory=_Client, config=None,
                connect_timeout=timeout_s, keepalive_count_max=_KEEPALIVE_COUNT,
                keepalive_interval=self.cluster.dead_after_s / (_KEEPALIVE_COUNT + 1),
                password_auth=False, kbdint_auth=False,
            ), timeout_s + 5.0)
        except asyncssh.HostKeyNotVerifiable:
            raise RemoteError(check.refusal()) from None
        except (Exception, asyncio.TimeoutError) as e:  # noqa: B014 - TimeoutError differs before 3.11
            raise RemoteError(connect_error_message(self.node, e, timeout_s)) from None
        await check.record()
        return conn

    async def forward_local(self, dest_host: str, dest_port: int):
        """A port on this machine's loopback that reaches `dest_host:dest_port` as the node sees it,
        through this node's SSH connection (a service that listens only on the node's private or
        overlay address stays reachable from here). Returns asyncssh's listener: `.get_port()`,
        `.close()`."""
        conn = await self.connect()
        return await conn.forward_local_port("127.0.0.1", 0, dest_host, dest_port)

    # --- commands ---------------------------------------------------------------------------

    async def run(self, command, timeout_s, env=None, cwd=None, input=None) -> CommandResult:
        return await self._execute(command, timeout_s, env, cwd, input, on_line=None)

    async def stream(self, command, on_line, timeout_s, env=None, cwd=None) -> CommandResult:
        return await self._execute(command, timeout_s, env, cwd, None, on_line=on_line)

    async def _execute(self, command, timeout_s, env, cwd, input, on_line) -> CommandResult:
        async with self._sessions:
            return await self._execute_now(command, timeout_s, env, cwd, input, on_line)

    async def _execute_now(self, command, timeout_s, env, cwd, input, on_line) -> CommandResult:
        t0 = time.monotonic()
        name = self.node.name

        def failed(error: str) -> CommandResult:
            return CommandResult(name, None, duration_s=time.monotonic() - t0, error=error)

        try:
            conn = await self.connect()
            shell = await self._with_input(to_shell(command), input)
            proc = await self._open_channel(conn, wrap_command(shell, env, cwd))
        except RemoteError as e:
            return failed(str(e))
        except Exception as e:
            from vpscluster.cluster.ssh_errors import channel_error_message

            return failed(channel_error_message(self.node, e))

        out, err = CappedText(), CappedText()
        pgid: list[int] = []
        sinks = [on_line] if on_line else []
        pumps = asyncio.gather(
            _pump(proc.stdout, "stdout", sinks, out, None),
            _pump(proc.stderr, "stderr", sinks, err, _StderrFilter(pgid.append)),
        )

        async def finish() -> None:
            await asyncio.shield(pumps)
            await proc.wait_closed()

        timed_out = False
        try:
            await asyncio.wait_for(finish(), timeout_s)
        except asyncio.TimeoutError:
            timed_out = True
            await self._end(proc, pgid, pumps)
        except asyncio.CancelledError:
            await asyncio.shield(self._end(proc, pgid, pumps))
            raise
        except Exception:  # the connection dropped while reading
            pass
        status = proc.exit_status
        error = None
        if not timed_out and (status is None or status < 0):
            status, error = None, self._lost or f"{name}: the SSH channel closed without an exit status"
        return CommandResult(name, None if timed_out else status, stdout=out.text(), stderr=err.text(),
                             duration_s=time.monotonic() - t0, timed_out=timed_out, error=error)

    async def _end(self, proc, pgid: list[int], pumps) -> None:
        """Kill the remote group of a running command and collect what its output still holds."""
        if pgid:
            await self.kill_group(pgid[0], grace_s=2.0)
        proc.close()  # the watchdog kills the group when the marker had not come yet
        try:
            await asyncio.wait_for(asyncio.gather(pumps, proc.wait_closed(), return_exceptions=True), 5.0)
        except asyncio.TimeoutError:
            pumps.cancel()

    async def _open_channel(self, conn, command_line: str):
        """A new session channel running `command_line`; a node gone dark cannot stall us here.

        A refused channel (the server's MaxSessions is reached, e.g. because it has not yet
        reaped a session that just ended) is retried with back-off until the connect time-out.
        """
        import asyncssh

        timeout_s = self.cluster.connect_timeout_s
        deadline = time.monotonic() + timeout_s
        pause_s = 0.05
        while True:
            try:
                return await asyncio.wait_for(conn.create_process(command_line, encoding=None),
                                              max(0.1, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                why = (f"{self.node.name}: {self.address} did not open a session within {timeout_s:g} s; "
                       "the node or its link may be down")
                self._gone_dark(conn, why)
                raise RemoteError(why) from None
            except asyncssh.ChannelOpenError:
                if time.monotonic() + pause_s > deadline:
                    raise
                await asyncio.sleep(pause_s)
                pause_s = min(1.0, pause_s * 2)

    def _gone_dark(self, conn, why: str) -> None:
        """The connection is up but the node answers nothing (a link down, a frozen host): every
        later call of this executor fails at once with `why` instead of waiting out its own
        time-out, and the connection is dropped without a goodbye (closing would wait on it)."""
        self._dark = why
        self._lost = self._lost or why
        if self._conn is conn:
            self._conn, self._sftp = None, None
        conn.abort()

    async def kill_group(self, pgid: int, grace_s: float) -> None:
        """TERM, then KILL, process group `pgid` on the node, through a channel of its own."""
        try:
            conn = await self.connect()
            await asyncio.wait_for(conn.run(kill_group_command(pgid, grace_s)), grace_s + 10.0)
        except Exception:
            pass  # unreachable: the watchdog ends the group when the connection drops

    async def _with_input(self, shell: str, data: str | bytes | None) -> str:
        """Make `data` the command's stdin: inline (base64) when small, else via a temp file."""
        if data is None:
            return shell
        raw = data.encode() if isinstance(data, str) else bytes(data)
        if len(raw) <= _INLINE_INPUT_MAX_BYTES:
            encoded = base64.b64encode(raw).decode()
            return f"printf %s {encoded} | base64 -d | {{\n{shell}\n}}"
        path = f"/tmp/vpscluster-input-{uuid.uuid4().hex}"
        sftp = await self._sftp_client()

        async def upload() -> None:
            async with sftp.open(path, "wb") as f:
                await f.write(raw)

        try:
            await asyncio.wait_for(upload(), self.cluster.command_timeout_s)
        except asyncio.TimeoutError:
            raise RemoteError(f"{self.node.name}: sending the command's input timed out") from None
        # Open it as stdin, then unlink it: nothing is left behind whatever the command does.
        return f"exec <{path} && rm -f {path}\n{shell}"

    async def start(self, command, on_line=None, env=None, cwd=None) -> SSHProcess:
        try:
            conn = await self.connect()
            proc = await self._open_channel(conn, wrap_command(to_shell(command), env, cwd))
        except RemoteError:
            raise
        except Exception as e:
            from vpscluster.cluster.ssh_errors import channel_error_message

            raise RemoteError(channel_error_message(self.node, e)) from None
        handle = SSHProcess(self, proc, on_line)
        self._started = [h for h in self._started if h.returncode is None] + [handle]
        return handle

    # --- files --------------------------------------------------------------------------------

    async def _sftp_client(self):
        conn = await self.connect()
        if self._sftp is None:
            self._sftp = await asyncio.wait_for(conn.start_sftp_client(), self.cluster.connect_timeout_s)
        return self._sftp

    async def put(self, local_path: str, remote_path: str, timeout_s: float = 300.0) -> None:
        from vpscluster.cluster.sftp import put_tree

        await self._transfer("put", local_path, remote_path, timeout_s, put_tree)

    async def get(self, remote_path: str, local_path: str, timeout_s: float = 300.0) -> None:
        from vpscluster.cluster.sftp import get_tree

        await self._transfer("get", remote_path, local_path, timeout_s, get_tree)

    async def _transfer(self, verb: str, src: str, dst: str, timeout_s: float, fn) -> None:
        where = f"{self.node.name}: {verb} {src} -> {dst}"
        try:
            sftp = await self._sftp_client()
            await asyncio.wait_for(fn(sftp, src, dst), timeout_s)
        except RemoteError:
            raise
        except asyncio.TimeoutError:
            raise RemoteError(f"{where} timed out after {timeout_s:g} s") from None
        except Exception as e:
            reason = getattr(e, "reason", None) or getattr(e, "strerror", None) or str(e) or type(e).__name__
            raise RemoteError(f"{where} failed: {reason}") from None

    async def close(self) -> None:
        running = [h for h in self._started if h.returncode is None]
        await asyncio.gather(*(h.stop(grace_s=2.0) for h in running), return_exceptions=True)
        conn, self._conn, self._sftp = self._conn, None, None
        if conn is not None:
            conn.close()
            try:
                await asyncio.wait_for(conn.wait_closed(), 5.0)
            except asyncio.TimeoutError:
                pass
