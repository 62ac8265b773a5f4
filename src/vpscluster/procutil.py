"""Local child processes: the one way a long-lived helper process is stopped."""

from __future__ import annotations

import subprocess


def stop(proc: subprocess.Popen, timeout_s: float = 10.0) -> None:
    """SIGTERM (the program may flush and close), SIGKILL if it is still there after `timeout_s`."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=timeout_s)
