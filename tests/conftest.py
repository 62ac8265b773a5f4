"""Shared test helpers. Distributed tests use 2-4 gloo processes on loopback with free ports.

Sandbox (emulated cluster) fixtures live in `sandbox_fixtures.py`; they need root and network
namespaces and skip with the reason when those are missing. With VPSC_TESTS_REQUIRE_SANDBOX=1
(CI) a skipping sandbox or SSH test fails instead (`strict_skips.py`).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from vpscluster.nodeside.free_port import free_port  # noqa: F401  (tests import it from here)

pytest_plugins = ["sandbox_fixtures", "strict_skips"]

REPO = Path(__file__).resolve().parents[1]


def run_cli(*args: str, timeout: float = 600, env: dict | None = None, cwd: str | None = None) -> subprocess.CompletedProcess:
    """Run `vpscluster ARGS...` as a user would, in a child process."""
    return subprocess.run(
        [sys.executable, "-m", "vpscluster", *args],
        capture_output=True, text=True, timeout=timeout, cwd=cwd,
        env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
    )


def pid_alive(pid: int) -> bool:
    """Running and not a zombie (zombies are dead; only reaping is pending)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2] != "Z"


def processes_mentioning(text: str) -> list[int]:
    """Live processes (not this one, not zombies) whose command line contains `text`; sandbox
    nodes share this PID space, so theirs are found too."""
    found = []
    for pid in os.listdir("/proc"):
        if pid.isdigit() and int(pid) != os.getpid():
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if text in cmd and pid_alive(int(pid)):
                found.append(int(pid))
    return found


@pytest.fixture
def cli():
    return run_cli
