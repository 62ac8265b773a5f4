"""Start and stop a long-running program on a node over its executor (shell lines, no I/O here).

`monitor up` (Prometheus, node exporters) and `queue up` (nats-server, its exporter) start their
servers this way: `setsid nohup ... &`, then wait until the program leads its own session, because
an executor ends the process group of a command when the command returns. They stop them with
`STOP_PID`, which kills a pid only while it is still the program named (pids get reused).
"""

from __future__ import annotations

import shlex

# An executor ends the process group of a command when it returns: wait until the started
# program leads its own session (setsid ran), so it outlives the command.
DETACHED_WAIT = ("for i in $(seq 100); do [ \"$(cut -d' ' -f6 /proc/$pid/stat 2>/dev/null)\" = \"$pid\" ] && break; "
                 "sleep 0.05; done")

# Stop a pid from a pid file only if it is still the program named (pids get reused).
STOP_PID = ("pid={pid}; if [ -n \"$pid\" ] && grep -q {pattern} /proc/$pid/cmdline 2>/dev/null; then kill $pid; "
            "for i in $(seq 100); do kill -0 $pid 2>/dev/null || break; sleep 0.1; done; kill -9 $pid 2>/dev/null; "
            "sleep 0.2; kill -0 $pid 2>/dev/null && echo left $pid; fi; true")


def start_line(argv: list[str], log: str, env: dict[str, str] | None = None) -> str:
    """A shell line starting `argv` detached (stdout and stderr to `log`) and printing its pid."""
    prefix = "".join(f"{k}={shlex.quote(v)} " for k, v in (env or {}).items())
    return (f"{prefix}setsid nohup {shlex.join(argv)} > {shlex.quote(log)} 2>&1 < /dev/null & pid=$!; "
            f"{DETACHED_WAIT}; echo $pid")


def stop_line(pid: int, pattern: str) -> str:
    """A shell line stopping `pid` (SIGTERM, then SIGKILL) if its command line holds `pattern`;
    prints `left PID` if it survived."""
    return STOP_PID.format(pid=int(pid), pattern=shlex.quote(pattern))
