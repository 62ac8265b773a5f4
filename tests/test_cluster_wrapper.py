"""The remote-command wrapper of the SSH executor, exercised without sshd: run the exact command
line sshd would get through /bin/sh here, with a pipe standing in for the SSH channel."""

from __future__ import annotations

import subprocess
import time

import pytest

from vpscluster.cluster.ssh import _StderrFilter, kill_group_command, remote_cd, wrap_command
from conftest import pid_alive


def wait_gone(pids, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not any(pid_alive(p) for p in pids):
            return True
        time.sleep(0.05)
    return False


def run_wrapped(command: str, env=None, cwd=None) -> tuple[int, str, str]:
    """Run as sshd would, keeping stdin (the channel) open until the command is done."""
    p = subprocess.Popen(["sh", "-c", wrap_command(command, env, cwd)], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out = p.stdout.read()
    err = p.stderr.read()
    code = p.wait(30)
    p.stdin.close()
    return code, out, err


def filtered(chunks: list[bytes]) -> tuple[bytes, list[int]]:
    ids: list[int] = []
    f = _StderrFilter(ids.append)
    return b"".join(f.feed(c) for c in chunks) + f.feed(b""), ids


@pytest.mark.parametrize("chunks, out, ids", [
    ([b"__VPSC_PGID__ 12\nerr\n"], b"err\n", [12]),
    ([b"__VPSC_", b"PGID__ 13", b"\nerr\n", b"more\n"], b"err\nmore\n", [13]),
    ([b"login noise\n__VPSC_PGID__ 14\nerr\n"], b"login noise\nerr\n", [14]),
    ([b"no marker at all\n"], b"no marker at all\n", []),
])
def test_marker_is_removed_and_reported(chunks, out, ids) -> None:
    assert filtered(chunks) == (out, ids)


def test_quoting_env_and_cwd() -> None:
    assert remote_cd("~") == 'cd "$HOME"'
    assert remote_cd("~/a b") == "cd \"$HOME\"/'a b'"
    assert remote_cd("/srv/x") == "cd /srv/x"
    with pytest.raises(ValueError, match="not an environment variable name"):
        wrap_command("true", {"BAD-NAME": "x"}, None)
    code, out, err = run_wrapped('echo "$A|$(pwd)"', {"A": "it's $HOME"}, "/tmp")
    assert (code, out) == (0, "it's $HOME|/tmp\n")
    assert err.startswith("__VPSC_PGID__ ")


def test_exit_status_and_leftovers_ended_when_the_command_exits() -> None:
    code, out, _ = run_wrapped("sleep 60 >/dev/null 2>&1 & echo $!; exit 5")
    assert code == 5
    assert wait_gone([int(out)]), "a background child outlived its command"


def test_stdin_at_eof_means_the_channel_is_gone() -> None:
    # We never send EOF over SSH; a closed stdin is how the wrapper learns the channel went away.
    # Repeated: the channel may close before the command has made its own process group, and
    # the wrapper must still end it (that race once left the command running).
    for _ in range(10):
        r = subprocess.run(["sh", "-c", wrap_command("sleep 60", None, None)], stdin=subprocess.DEVNULL,
                           capture_output=True, text=True, timeout=30)
        assert r.returncode == 143


def test_channel_close_kills_the_group() -> None:
    # stdin is the channel: closing it is what sshd does when the client or the link goes away.
    p = subprocess.Popen(["sh", "-c", wrap_command("sleep 60 & echo $!; sleep 60", None, None)],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    child = int(p.stdout.readline())
    pgid = int(p.stderr.readline().split()[1])
    assert pid_alive(child) and pid_alive(pgid)
    p.stdin.close()
    assert p.wait(30) == 143
    assert wait_gone([child, pgid])


def test_kill_group_command_terms_then_kills() -> None:
    p = subprocess.Popen(["sh", "-c", wrap_command("trap '' TERM; sleep 60 & echo $!; wait", None, None)],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    child = int(p.stdout.readline())
    pgid = int(p.stderr.readline().split()[1])
    t0 = time.monotonic()
    subprocess.run(["sh", "-c", kill_group_command(pgid, grace_s=0.5)], check=True, timeout=30)
    assert time.monotonic() - t0 < 10
    assert wait_gone([child, pgid])
    p.stdin.close()
    assert p.wait(30) in (137, 143)
