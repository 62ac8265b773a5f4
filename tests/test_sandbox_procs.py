"""The sandbox's checks of whether a process still lives (`netns.kill_pids`, `sshd.alive`).

A process can end between opening /proc/PID/stat and reading it; the read then fails with ESRCH
(ProcessLookupError), not ENOENT. That is a process gone, and must read as one: once it escaped
`netns._alive` as a traceback from `sandbox fault reboot` (CI, a node's processes dying under
the kill)."""

from __future__ import annotations

import subprocess
from pathlib import Path

from vpscluster.cluster.sandbox import netns, sshd


def test_kill_pids_waits_until_a_real_process_is_gone():
    p = subprocess.Popen(["sleep", "30"])
    try:
        assert netns._alive(p.pid)
        assert netns.kill_pids([p.pid], timeout_s=5.0) == []  # a zombie awaiting its parent counts as gone
    finally:
        p.kill()
        p.wait(timeout=10)
    assert not netns._alive(p.pid) and not sshd.alive(p.pid)


def test_a_process_gone_between_open_and_read_reads_as_gone(monkeypatch):
    def vanished(*_args, **_kwargs):
        raise ProcessLookupError(3, "No such process")

    p = subprocess.Popen(["sleep", "30"])
    try:
        monkeypatch.setattr("builtins.open", vanished)
        monkeypatch.setattr(Path, "read_text", vanished)
        assert netns._alive(p.pid) is False
        assert sshd.alive(p.pid) is False
    finally:
        monkeypatch.undo()
        p.kill()
        p.wait(timeout=10)
