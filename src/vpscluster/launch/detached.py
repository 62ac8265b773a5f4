"""Runs whose launcher works in the background: `train|run --detach`, `attach RUN`, `stop RUN`.

`train --detach` validates the run as usual, then starts the same `vpscluster train` command as
a launcher process of its own (a new session, no terminal: closing the terminal or the SSH
session it was typed in does not stop it) and returns. Everything about it lives in the run dir:

    RUN_DIR/launcher.json       {"pid", "argv", "started", "log"}; the launcher adds
                                "exit_status" and "message" when it ends
    RUN_DIR/logs/detached.log   the launcher's own output (what `train` prints in a terminal)

One launcher per run: `start` refuses while the run's launcher lock is held or the launcher that
launcher.json names still runs (launch/runlock.py); a stale launcher.json of a dead launcher is
replaced, and a second launcher that slips past that check is refused by the lock itself,
without touching the first's launcher.json (`finish` writes only its own).

`stop` sends the launcher SIGTERM, which is Ctrl-C for it: every rank saves a checkpoint at the
next step boundary and the launcher stops every process on every node; after a time-out it is
killed, and its node-side guards still stop the workers (after their own grace period).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from vpscluster import fsutil
from vpscluster.errors import UserError
from vpscluster.train import rundir

STATE = "launcher.json"
LOG = "detached.log"


def log_path(run_dir: Path) -> Path:
    return Path(run_dir) / "logs" / LOG


def start(run_dir: Path, argv: list[str]) -> dict[str, Any]:
    """Start `vpscluster ARGV...` in the background, its output to RUN_DIR/logs/detached.log."""
    run_dir = Path(run_dir)
    check_free(run_dir)
    log = log_path(run_dir)
    log.parent.mkdir(parents=True, exist_ok=True)
    (run_dir / STATE).unlink(missing_ok=True)  # a previous detached session's, whose launcher is gone (a resume)
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "vpscluster", *argv], stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    # Merged: a launcher that already failed has written its exit status (finish).
    state = {**(read_state(run_dir) or {}), "pid": proc.pid, "argv": argv, "started": time.time(), "log": str(log)}
    fsutil.write_json(run_dir / STATE, state)
    return state


def check_free(run_dir: Path, controller: str | None = None) -> None:
    """Refuse (one line) when a launcher already runs this run: it holds the run's lock, or
    launcher.json names a launcher that is alive. A dead launcher's leftovers do not count.
    A run whose launcher is on a controller node is continued only on a controller
    (`controller`: the node asked for; launch/controller.py `resume` asks the old one)."""
    from vpscluster.launch import runlock

    held = runlock.holder(run_dir)
    if held is not None:
        raise runlock.refusal(Path(run_dir), held)
    state = read_state(run_dir)
    if state is not None and state.get("controller") and not controller:
        from vpscluster.launch.controller import continue_command

        raise UserError(f"run {run_dir} has its launcher on node {state['controller']}: follow it with vpscluster attach "
                        f"{run_dir}, stop it with vpscluster stop {run_dir}; to continue it once its launcher is gone, run "
                        f"{continue_command(state, run_dir)}")
    if state is not None and state.get("pid") != os.getpid() and running(state):
        import socket

        raise runlock.refusal(Path(run_dir), {"pid": state["pid"], "host": socket.gethostname(), "started": state.get("started")})


def finish(run_dir: Path, exit_status: int, message: str | None) -> None:
    """The detached launcher's last word, for `attach` and `stop` to read. Never over the state
    of another launcher that still runs (a second launcher refused by the lock)."""
    state = read_state(run_dir) or {}
    if state.get("pid") not in (None, os.getpid()) and running(state):
        return
    state.update(exit_status=exit_status, message=message, ended=time.time())
    fsutil.write_json(Path(run_dir) / STATE, state)


def read_state(run_dir: Path) -> dict[str, Any] | None:
    try:
        return json.loads((Path(run_dir) / STATE).read_text())
    except (OSError, ValueError):
        return None


def find_run(ref: str, base: str | Path = "runs") -> Path:
    """A detached run named by its directory or by its run id under `base`; one-line error otherwise."""
    d = rundir.find(ref, base)
    if not (d / STATE).is_file():
        raise UserError(f"run {ref} was not started with --detach (no {STATE}); only detached runs can be attached or stopped")
    return d


def running(state: dict[str, Any]) -> bool:
    """The launcher process still runs (and is the one started: same pid, a vpscluster command, not a zombie)."""
    pid = state.get("pid")
    if state.get("controller"):
        return False  # its pid is on the controller node, not here (launch/controller.py asks there)
    if not isinstance(pid, int) or state.get("exit_status") is not None and state.get("ended"):
        return False
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2] != "Z" and b"vpscluster" in cmdline


def stop(run_dir: Path, timeout_s: float) -> dict[str, Any]:
    """SIGTERM the launcher (a checkpoint, then every process stopped); SIGKILL after `timeout_s`.
    Returns the final state plus "forced": whether it had to be killed."""
    state = read_state(run_dir) or {}
    if not running(state):
        raise UserError(f"run {run_dir} is not running ({_ended(state)}); continue it with: {resume_command(run_dir)}")
    pid = state["pid"]
    os.kill(pid, signal.SIGTERM)
    forced = not _wait_gone(state, timeout_s)
    if forced:
        try:
            os.kill(pid, signal.SIGKILL)  # the node-side guards see their launcher gone and stop the rest
        except ProcessLookupError:
            pass
        _wait_gone(state, 10.0)
    _reap_if_child(pid)
    return {**(read_state(run_dir) or state), "forced": forced}


def resume_command(run_dir: Path) -> str:
    """How to continue a detached run: `train --resume`, or for a script `run --resume ... -- COMMAND`."""
    argv = (read_state(run_dir) or {}).get("argv") or ["train"]
    if argv[0] == "run" and "--" in argv:
        return f"vpscluster run --resume {run_dir} --detach {' '.join(argv[argv.index('--'):])}"
    return f"vpscluster train --resume {run_dir} --detach"


def stop_grace_s(run_dir: Path) -> float:
    """How long the run's ranks may take to stop (checkpoint first): its own setting where the
    run dir holds it (train's config.yaml, a script's session.json), else the default."""
    from vpscluster.train.config import TimeoutConfig

    run_dir = Path(run_dir)
    try:
        if (run_dir / rundir.CONFIG).is_file():
            return rundir.read_config(run_dir).timeouts.stop_grace_s
        from vpscluster.session.config import FILE, read

        if (run_dir / FILE).is_file():
            return read(run_dir / FILE).timeouts.stop_grace_s
    except UserError:
        pass  # unreadable: the default
    return TimeoutConfig().stop_grace_s


def _wait_gone(state: dict[str, Any], seconds: float) -> bool:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if not running({**state, "exit_status": None}):
            return True
        time.sleep(0.2)
    return not running({**state, "exit_status": None})


def _reap_if_child(pid: int) -> None:
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


def _ended(state: dict[str, Any]) -> str:
    if state.get("exit_status") is None:
        return "its launcher is gone without an exit status (killed?)"
    msg = f"; {state['message']}" if state.get("message") else ""
    return f"it ended with exit status {state['exit_status']}{msg}"


def describe_end(state: dict[str, Any]) -> str:
    return _ended(state)


PROGRESS = "progress.jsonl"
_PROGRESS_KINDS = ("start", "resume", "step", "eval", "checkpoint", "end", "error", "node_drained")


def progress_sink(run_dir: Path):
    """The detached launcher's record of rank 0's events as they arrive (RUN_DIR/progress.jsonl,
    one JSON line each, with the time `t`): the run's progress is readable while it goes, where
    metrics.jsonl and report.json reach the run dir only at the end (`report` shows it)."""
    path = Path(run_dir) / PROGRESS

    def sink(event: dict[str, Any]) -> None:
        if event.get("event") not in _PROGRESS_KINDS:
            return
        doc = {k: v for k, v in event.items() if k != "report"} | {"t": round(time.time(), 2)}
        try:
            with path.open("a") as f:
                f.write(json.dumps(doc, default=str, separators=(",", ":")) + "\n")
        except OSError:
            pass  # a full or gone disk must not stop the run; the progress view is only late

    return sink


def progress_line(run_dir: Path) -> str | None:
    """One line of the run's progress so far (from RUN_DIR/progress.jsonl), or None without one."""
    try:
        lines = (Path(run_dir) / PROGRESS).read_text().splitlines()
    except OSError:
        return None
    last: dict[str, dict[str, Any]] = {}
    for raw in lines:
        try:
            doc = json.loads(raw)
        except ValueError:
            continue  # a line cut short by a killed launcher
        if isinstance(doc, dict):
            last[str(doc.get("event"))] = doc
    if not last:
        return None
    parts = []
    step = last.get("step")
    if step:
        parts.append(f"step {step.get('step')} of {step.get('max_steps')}, loss {float(step.get('loss') or 0):.4f}, "
                     f"{float(step.get('tokens_per_s') or 0):.0f} tokens/s")
    if "eval" in last:
        parts.append(f"validation loss {float(last['eval'].get('val_loss') or 0):.4f} at step {last['eval'].get('step')}")
    if "checkpoint" in last:
        parts.append(f"last checkpoint at step {last['checkpoint'].get('step')}")
    t = max(float(d.get("t") or 0) for d in last.values())
    parts.append(f"updated {max(0.0, time.time() - t):.0f} s ago")
    return "; ".join(parts)
