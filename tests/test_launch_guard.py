"""Nothing left behind: a launcher killed with SIGKILL (no teardown of its own can run) leaves no
process of its launch on any node after a bounded time — the node-side guard notices that the
launcher is gone (its parent changed, or the SSH channel closed) and stops every process of the
launch, torchrun's workers in their own sessions included.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest


REPO = Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "tests" / "scripts"
BOUND_S = 15.0  # guard: 0.5 s poll + 5 s grace + 3 s kill wait, with room for a loaded machine


def launch_processes(launch_id: str | None = None, needle: str | None = None) -> list[str]:
    """Live processes carrying VPSC_LAUNCH_ID (= launch_id when given) whose command line holds `needle`."""
    found = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            env = Path(f"/proc/{d}/environ").read_bytes().split(b"\0")
            cmd = Path(f"/proc/{d}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        tag = [e for e in env if e.startswith(b"VPSC_LAUNCH_ID=")]
        if not tag or state == "Z":
            continue
        if launch_id is not None and tag[0] != f"VPSC_LAUNCH_ID={launch_id}".encode():
            continue
        if needle is None or needle in cmd:
            found.append(f"{d} {cmd[:150]}")
    return found


def wait_for_log(run_dir: Path, text: str, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        logs = list((run_dir / "logs").glob("*.log")) if (run_dir / "logs").exists() else []
        if sum(text in p.read_text(errors="replace") for p in logs) >= 2:
            return
        time.sleep(0.3)
    raise AssertionError(f"{text!r} not in two node logs within {timeout_s:.0f} s; launcher: "
                         f"{proc.poll()} {proc.stderr.read()[-1500:] if proc.poll() is not None else ''}")


def kill_and_watch(proc: subprocess.Popen, left) -> float:
    """SIGKILL the launcher; seconds until `left()` is empty (fails after BOUND_S)."""
    assert left(), "the launch runs nothing to leave behind"
    sent = time.monotonic()
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)
    while left() and time.monotonic() - sent < BOUND_S:
        time.sleep(0.25)
    assert left() == [], f"still running {time.monotonic() - sent:.1f} s after the launcher was killed"
    return time.monotonic() - sent


@pytest.mark.slow
def test_sigkilled_local_train_leaves_nothing(tmp_path):
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "vpscluster", "train", "--nodes", "2", "--preset", "tiny", "--max-steps", "100000",
         "--run-dir", str(run_dir)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
        cwd=tmp_path,
    )
    try:
        # Both workers started (a first step may take long on a loaded machine; it is not needed).
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None and len(_workers(run_dir)) < 2:
            time.sleep(0.3)
        assert proc.poll() is None and len(_workers(run_dir)) == 2, proc.stderr.read()[-1500:] if proc.poll() is not None else "no workers"
        # One launcher per run: a resume while this one trains is refused, naming it.
        second = subprocess.run([sys.executable, "-m", "vpscluster", "train", "--resume", str(run_dir)],
                                capture_output=True, text=True, timeout=120, cwd=tmp_path)
        assert second.returncode == 2 and len(second.stderr.strip().splitlines()) == 1, second.stderr[-2000:]
        assert f"already has a launcher running (pid {proc.pid} on " in second.stderr and f"kill {proc.pid}" in second.stderr
        assert len(_workers(run_dir)) == 2
        kill_and_watch(proc, lambda: launch_processes(needle=str(run_dir)))
        # The SIGKILLed launcher's lock went with it.
        from vpscluster.launch import runlock

        assert runlock.holder(run_dir) is None
    finally:
        if proc.poll() is None:
            proc.kill()


def _workers(run_dir: Path) -> list[str]:
    return [p for p in launch_processes(needle=str(run_dir)) if "vpscluster.train.worker" in p]


@pytest.mark.sandbox
@pytest.mark.slow
def test_sigkilled_launcher_leaves_nothing_on_sandbox_nodes(shared2, tmp_path):
    # The session's shared 2-node sandbox: the guard leaves nothing of this launch behind (what
    # this test checks), so later modules find the nodes as they were.
    info = shared2
    launch_id = f"ft{uuid.uuid4().hex[:12]}"
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "vpscluster", "run", "--cluster", info.cluster_file, "--sync", str(SCRIPTS),
         "--rdzv-id", launch_id, "--run-dir", str(run_dir), "--", "python", "sleep_forever.py"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        wait_for_log(run_dir, "ready rank", proc, timeout_s=90)
        # Workers, torchrun agents and guards, on both nodes.
        before = launch_processes(launch_id)
        assert len(before) >= 4
        # A second launch of the same run (its id: the run folder's name), from another local
        # folder, as from another machine: the nodes' run lock refuses it; the first is unharmed.
        second = subprocess.run(
            [sys.executable, "-m", "vpscluster", "run", "--cluster", info.cluster_file, "--sync", str(SCRIPTS),
             "--run-dir", str(tmp_path / "elsewhere" / "run"), "--", "python", "sleep_forever.py"],
            capture_output=True, text=True, timeout=180, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        assert second.returncode != 0 and "run run already runs on this node" in second.stderr, second.stderr[-2000:]
        assert f"(launch {launch_id}: its guard" in second.stderr, second.stderr[-2000:]
        assert proc.poll() is None and launch_processes(launch_id) == before
        kill_and_watch(proc, lambda: launch_processes(launch_id))
    finally:
        if proc.poll() is None:
            proc.kill()


def test_node_lock_refuses_a_second_launch_of_the_run_while_the_first_lives(tmp_path):
    """The guard's run lock on a node: a second launch of the same run is refused (its command
    never starts) while the first's guard lives, and still while the first's workers live after
    their guard died; once they are gone the next launch goes ahead."""
    from vpscluster import nodeside
    from vpscluster.nodeside.reap import LOCKED

    (tmp_path / "run").mkdir()
    lock = str(tmp_path / "run" / "launch.lock")
    started = tmp_path / "started"

    def guard(launch_id: str, command: str) -> subprocess.Popen:
        argv = nodeside.command(sys.executable, "reap", "guard", "VPSC_LAUNCH_ID", launch_id, "1", "--lock", lock,
                                "/bin/sh", "-c", f"exec env VPSC_LAUNCH_ID={launch_id} {command}")
        return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    first_id = f"lk{uuid.uuid4().hex[:10]}"
    first = guard(first_id, "sleep 120")
    try:
        deadline = time.monotonic() + 20
        while not launch_processes(first_id):
            assert time.monotonic() < deadline and first.poll() is None, first.stderr.read() if first.poll() is not None else "no worker"
            time.sleep(0.1)
        record = json.loads(Path(lock).read_text())
        assert record["launch_id"] == first_id and record["run"] == "run" and record["guard_pid"] == first.pid

        second = guard("lk-second", f"touch {started}")
        _, err = second.communicate(timeout=30)
        assert second.returncode == LOCKED and not started.exists(), err
        assert len(err.strip().splitlines()) == 1 and f"run run already runs on this node (launch {first_id}" in err, err
        assert "vpscluster stop RUN_DIR" in err
        assert first.poll() is None and launch_processes(first_id)  # the first is unharmed

        # Its guard dies (SIGKILL: no reaping); the worker it leaves still holds the run.
        first.kill()
        first.wait(timeout=10)
        assert launch_processes(first_id)
        third = guard("lk-third", f"touch {started}")
        _, err = third.communicate(timeout=30)
        assert third.returncode == LOCKED and not started.exists() and "of its processes live" in err, err

        reaped = subprocess.run(nodeside.command(sys.executable, "reap", "VPSC_LAUNCH_ID", first_id, "1", "3"),
                                capture_output=True, text=True, timeout=30)
        assert json.loads(reaped.stdout)["left"] == []
        fourth = guard("lk-fourth", f"touch {started}")
        _, err = fourth.communicate(timeout=30)
        assert fourth.returncode == 0 and started.exists(), err
        assert json.loads(Path(lock).read_text())["launch_id"] == "lk-fourth"
    finally:
        if first.poll() is None:
            first.kill()
        subprocess.run(nodeside.command(sys.executable, "reap", "VPSC_LAUNCH_ID", first_id, "1", "3"),
                       capture_output=True, timeout=30)
