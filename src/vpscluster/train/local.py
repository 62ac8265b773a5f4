"""The local cluster: N worker processes on this machine, started by PyTorch's elastic launcher.

    python -m torch.distributed.run --standalone --nnodes 1 --nproc-per-node N \\
        -m vpscluster.train.worker --run-dir DIR [--resume]

runs in its own process group (so one signal reaches the launcher and every worker). Its merged
output is read line by line: `VPSC_EVENT` lines drive the `ProgressView`, every line goes to
DIR/logs/launcher.log (each rank also writes DIR/logs/rank-N.log itself). On Ctrl-C, on a
worker failure, or when the job has been silent for longer than its time-outs allow, the whole
group is stopped (SIGTERM, then SIGKILL) so nothing is left running.
"""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from vpscluster.errors import UserError
from vpscluster.train import events, rundir
from vpscluster.train.config import TrainConfig

STOP_GRACE_S = 15.0  # SIGTERM -> SIGKILL


class TrainingFailed(UserError):
    """The workers failed; the message names the first error and where the logs are."""

    exit_code = 1


def threads_per_rank(cfg: TrainConfig, nproc: int) -> int:
    return cfg.threads_per_rank or max(1, (os.cpu_count() or 1) // nproc)


def build_command(cfg: TrainConfig, run_dir: Path, resume: bool) -> list[str]:
    cmd = [
        sys.executable, "-m", "torch.distributed.run",
        "--standalone", "--nnodes", "1", "--nproc-per-node", str(cfg.nodes),
        "--max-restarts", "0", "--monitor-interval", "1",
        "--rdzv-conf", f"join_timeout={int(cfg.timeouts.rendezvous_s)}",
        "-m", "vpscluster.train.worker", "--run-dir", str(run_dir),
    ]
    return cmd + (["--resume"] if resume else [])


def launch_local(cfg: TrainConfig, run_dir: Path, *, resume: bool = False, view=None) -> dict[str, Any]:
    """Run the job to the end and return its report (raises TrainingFailed)."""
    run_dir = Path(run_dir)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads_per_rank(cfg, cfg.nodes))}
    log_path = run_dir / rundir.LOGS / "launcher.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen(
        build_command(cfg, run_dir, resume), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL, env=env, text=True, bufsize=1, start_new_session=True,
    )
    lines: queue.Queue[str | None] = queue.Queue()
    reader = threading.Thread(target=_pump, args=(proc.stdout, lines), daemon=True)
    reader.start()
    errors: list[str] = []
    deaths: list[str] = []  # torchrun's own account of a worker that died without an error event
    started = False
    last_output = time.monotonic()
    try:
        with log_path.open("a", buffering=1) as log:
            while True:
                # Quiet for longer than the workers' own time-outs: something hangs that they cannot see.
                silence_s = (2 * cfg.timeouts.train_collective_s + 60) if started else (
                    cfg.timeouts.rendezvous_s + cfg.timeouts.startup_collective_s)
                try:
                    line = lines.get(timeout=0.5)
                except queue.Empty:
                    if time.monotonic() - last_output > silence_s:
                        raise TrainingFailed(
                            f"training printed nothing for {silence_s:.0f} s and was stopped; see {log_path.parent}"
                        )
                    continue
                if line is None:  # the launcher closed its output: it is exiting
                    break
                last_output = time.monotonic()
                log.write(line)
                ev = events.parse_event(line)
                if ev is None:
                    death = _worker_death(line)
                    if death:
                        deaths.append(death)
                    if line.lstrip().startswith("warning:") and view is not None:
                        view.log_line(line.rstrip())
                    continue
                started = started or ev["event"] == "start"
                if ev["event"] == "error":
                    errors.append(f"rank {ev.get('rank')}: {ev.get('message')}")
                if view is not None:
                    view.handle(ev)
        rc = proc.wait(timeout=STOP_GRACE_S + cfg.timeouts.train_collective_s)
    except BaseException:
        _stop_group(proc)
        raise
    finally:
        if view is not None:
            view.close()
    _stop_group(proc)  # nothing of the group may outlive the launcher
    if rc != 0:
        # A rank killed by a signal is the root cause; its peers' errors (lost connection) follow from it.
        killed = [d for d in deaths if "killed by" in d]
        first = (killed or errors or deaths or [f"torch.distributed.run exited with status {rc}"])[0]
        raise TrainingFailed(f"training failed: {first}; logs in {run_dir / rundir.LOGS}")
    return rundir.read_report(run_dir)


_DEATH = re.compile(r"failed \(exitcode: (-?\d+)\) local_rank: (\d+)")


def _worker_death(line: str) -> str | None:
    """torchrun's 'failed (exitcode: -9) local_rank: 1' line, said for people."""
    m = _DEATH.search(line)
    if not m:
        return None
    code, local_rank = int(m.group(1)), m.group(2)
    how = f"was killed by {signal.Signals(-code).name}" if code < 0 and -code in signal.valid_signals() else f"exited with status {code}"
    return f"local rank {local_rank} {how}"


def _pump(stream, out: queue.Queue) -> None:
    try:
        for line in stream:
            out.put(line)
    finally:
        out.put(None)


def _stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM the launcher's process group, then SIGKILL whatever is left after a grace period."""
    try:
        pgid = os.getpgid(proc.pid)
    except ProcessLookupError:
        pgid = proc.pid  # the launcher is gone; its workers still carry its group id
    for sig, wait_s in ((signal.SIGTERM, STOP_GRACE_S), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            break  # the group is empty
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if proc.poll() is not None and not _group_alive(pgid):
                return
            time.sleep(0.1)
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
