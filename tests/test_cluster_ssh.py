"""SSHExecutor against real, throwaway sshd processes on 127.0.0.1 (root only).

Host keys (unknown refused, accept-new recorded, changed always refused), commands with exit
status / env / cwd / stdin, streaming, time-outs and stop() ending the remote process group
(children included), no orphans when the connection drops, SFTP trees, unreachable nodes.
The "remote" processes run on this machine, so the tests check their pids directly.
"""

from __future__ import annotations

import asyncio
import dataclasses
import socket
import time
from pathlib import Path

import pytest

from cluster_sshd import SSHDFarm, free_port, sshd_unavailable_reason
from conftest import pid_alive
from vpscluster.cluster.inventory import load_cluster, open_executors
from vpscluster.cluster.node import Node
from vpscluster.errors import RemoteError

pytestmark = [pytest.mark.ssh, pytest.mark.skipif(sshd_unavailable_reason() is not None, reason=sshd_unavailable_reason() or "")]

TIMEOUT_S = 30.0  # generous: CI machines are shared; tests that time things use their own


async def wait_until(predicate, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        await asyncio.sleep(0.1)
    return predicate()


@pytest.fixture(scope="module")
def farm(tmp_path_factory):
    farm = SSHDFarm(tmp_path_factory.mktemp("sshd"), 2)
    yield farm
    farm.stop()


@pytest.fixture
def cluster(farm, tmp_path):
    known_hosts = farm.known_hosts(tmp_path / "known_hosts")
    return load_cluster(farm.cluster_yaml(tmp_path / "cluster.yaml", known_hosts))


def on_first(cluster, fn):
    async def go():
        async with open_executors(cluster) as executors:
            return await fn(executors[0])

    return asyncio.run(go())


# --- host keys --------------------------------------------------------------------------------


def test_unknown_host_key_is_refused_and_nothing_recorded(farm, tmp_path) -> None:
    known_hosts = tmp_path / "known_hosts"
    known_hosts.write_text("")
    cluster = load_cluster(farm.cluster_yaml(tmp_path / "cluster.yaml", known_hosts))
    r = on_first(cluster, lambda ex: ex.run("echo should not run", TIMEOUT_S))
    port = farm.nodes[0].port
    assert r.exit_status is None and r.stdout == ""
    assert r.error.startswith(f"node-a: unknown host key for [127.0.0.1]:{port} (ssh-ed25519 SHA256:")
    assert "--accept-new-host-keys" in r.error and str(known_hosts) in r.error and "\n" not in r.error
    assert known_hosts.read_text() == ""


def test_accept_new_records_the_key_and_the_next_connection_needs_no_flag(farm, tmp_path) -> None:
    known_hosts = tmp_path / "sub" / "known_hosts"  # the folder does not exist yet either
    cluster = load_cluster(farm.cluster_yaml(tmp_path / "cluster.yaml", known_hosts, accept_new_host_keys=True))
    assert on_first(cluster, lambda ex: ex.run("echo ok", TIMEOUT_S)).stdout == "ok\n"
    assert known_hosts.read_text() == farm.nodes[0].known_hosts_line()  # exactly the server's key, OpenSSH format

    strict = dataclasses.replace(cluster, accept_new_host_keys=False)
    r = on_first(strict, lambda ex: ex.run("echo again", TIMEOUT_S))
    assert r.ok and r.stdout == "again\n"
    assert known_hosts.read_text() == farm.nodes[0].known_hosts_line()  # not recorded twice


def test_changed_host_key_is_refused_loudly_even_with_accept_new(tmp_path) -> None:
    farm = SSHDFarm(tmp_path / "one", 1)
    try:
        known_hosts = farm.known_hosts(tmp_path / "known_hosts")
        before = known_hosts.read_text()
        farm.replace_host_key(0)  # a reinstalled server, or someone in the middle
        cluster = load_cluster(farm.cluster_yaml(tmp_path / "cluster.yaml", known_hosts, accept_new_host_keys=True))
        r = on_first(cluster, lambda ex: ex.run("echo should not run", TIMEOUT_S))
    finally:
        farm.stop()
    assert r.exit_status is None and r.stdout == ""
    assert r.error.startswith(f"node-a: HOST KEY CHANGED for [127.0.0.1]:{farm.nodes[0].port}")
    assert "man-in-the-middle" in r.error and "Refusing to connect" in r.error and "ssh-keygen -R" in r.error
    assert known_hosts.read_text() == before  # never overwritten


def test_hashed_known_hosts_entries_are_honoured(farm, tmp_path) -> None:
    import subprocess

    known_hosts = farm.known_hosts(tmp_path / "known_hosts")
    subprocess.run(["ssh-keygen", "-H", "-f", str(known_hosts)], check=True, capture_output=True)
    assert "127.0.0.1" not in known_hosts.read_text()
    cluster = load_cluster(farm.cluster_yaml(tmp_path / "cluster.yaml", known_hosts))
    assert on_first(cluster, lambda ex: ex.run("echo ok", TIMEOUT_S)).stdout == "ok\n"


# --- commands -------------------------------------------------------------------------------


def test_run_exit_status_streams_env_cwd_and_input(cluster) -> None:
    async def go(ex):
        failing = await ex.run("echo out; echo err >&2; exit 3", TIMEOUT_S)
        argv = await ex.run(["printf", "%s|", "two words", "$HOME"], TIMEOUT_S)
        env_cwd = await ex.run('pwd; echo "$VPSC_X"', TIMEOUT_S, env={"VPSC_X": "a 'b' c"}, cwd="/tmp")
        home = await ex.run("pwd", TIMEOUT_S, cwd="~")
        piped = await ex.run("tr a-z A-Z", TIMEOUT_S, input="abc\nno newline")
        big = await ex.run("sha256sum", TIMEOUT_S, input=bytes(range(256)) * 1024)  # 256 KiB goes by SFTP
        silent = await ex.run("cat", TIMEOUT_S)  # stdin is /dev/null: no hang
        missing = await ex.run("true", TIMEOUT_S, cwd="/nonexistent")
        return failing, argv, env_cwd, home, piped, big, silent, missing

    failing, argv, env_cwd, home, piped, big, silent, missing = on_first(cluster, go)
    assert (failing.exit_status, failing.stdout, failing.stderr, failing.error) == (3, "out\n", "err\n", None)
    assert argv.stdout == "two words|$HOME|"
    assert env_cwd.stdout == "/tmp\na 'b' c\n"
    assert home.stdout == str(Path("~").expanduser()) + "\n"
    assert piped.stdout == "ABC\nNO NEWLINE"
    import hashlib

    assert big.stdout.split()[0] == hashlib.sha256(bytes(range(256)) * 1024).hexdigest()
    assert silent.ok and silent.stdout == ""
    assert missing.exit_status == 126 and "can't cd" in missing.stderr
    assert not list(Path("/tmp").glob("vpscluster-input-*"))  # the big input's file is gone


def test_one_connection_is_reused(cluster) -> None:
    async def go(ex):
        results = [await ex.run("echo $SSH_CONNECTION", TIMEOUT_S) for _ in range(2)]
        results += await asyncio.gather(*(ex.run("echo $SSH_CONNECTION", TIMEOUT_S) for _ in range(4)))
        return results

    results = on_first(cluster, go)
    assert all(r.ok for r in results)
    assert len({r.stdout for r in results}) == 1  # same client port every time


def test_more_commands_at_once_than_sshd_allows_sessions(cluster) -> None:
    # sshd's default MaxSessions is 10 per connection; 2 long-lived processes + 12 commands fit.
    async def go(ex):
        long_lived = [await ex.start("sleep 60") for _ in range(2)]
        results = await asyncio.gather(*(ex.run(f"echo {i}", TIMEOUT_S) for i in range(12)))
        for handle in long_lived:
            await handle.stop(grace_s=1)
        return results

    results = on_first(cluster, go)
    assert [r.error for r in results] == [None] * 12
    assert [r.stdout for r in results] == [f"{i}\n" for i in range(12)]


def test_stream_delivers_lines_as_they_come(cluster) -> None:
    seen: list[tuple[float, str, str]] = []

    async def go(ex):
        return await ex.stream("for i in 1 2 3; do echo line$i; sleep 0.5; done; echo bad >&2",
                               lambda s, line: seen.append((time.monotonic(), s, line)), TIMEOUT_S)

    r = on_first(cluster, go)
    assert r.ok and r.stdout == "line1\nline2\nline3\n" and r.stderr == "bad\n"
    assert [(s, line) for _, s, line in seen] == [("stdout", "line1"), ("stdout", "line2"), ("stdout", "line3"),
                                                  ("stderr", "bad")]
    assert seen[2][0] - seen[0][0] > 0.7


def test_timeout_kills_the_remote_group(cluster) -> None:
    async def go(ex):
        await ex.run("true", TIMEOUT_S)  # connect first: time only the command
        t0 = time.monotonic()
        r = await ex.run("sleep 120 & echo child $!; sleep 120", 2.0)
        return r, time.monotonic() - t0

    r, elapsed = on_first(cluster, go)
    assert r.timed_out and r.exit_status is None and r.error is None
    assert r.stdout.startswith("child ") and "__VPSC_PGID__" not in r.stderr
    assert elapsed < 2.0 + 15.0
    child = int(r.stdout.split()[1])
    assert asyncio.run(wait_until(lambda: not pid_alive(child), 10.0)), "the background child survived the time-out"


def test_start_stop_ends_the_group_with_its_children(cluster) -> None:
    lines: list[str] = []

    async def go(ex):
        handle = await ex.start("sleep 120 & echo child $!; exec sleep 120", on_line=lambda s, line: lines.append(line))
        assert await wait_until(lambda: bool(lines) and handle.pgid is not None, TIMEOUT_S)
        child = int(lines[0].split()[1])
        assert pid_alive(child) and pid_alive(handle.pgid)
        assert await handle.wait(0.5) is None and handle.returncode is None
        await handle.stop(grace_s=2)
        await handle.stop(grace_s=2)  # safe twice
        return handle, child

    handle, child = on_first(cluster, go)
    assert handle.returncode == 143
    assert asyncio.run(wait_until(lambda: not pid_alive(child) and not pid_alive(handle.pgid), 10.0))


def test_dropped_connection_leaves_no_orphans(cluster) -> None:
    lines: list[str] = []

    async def go(ex):
        handle = await ex.start("sleep 120 & echo child $!; sleep 120", on_line=lambda s, line: lines.append(line))
        assert await wait_until(lambda: bool(lines) and handle.pgid is not None, TIMEOUT_S)
        (await ex.connect()).abort()  # no stop(), no kill channel: the link just goes away
        assert await handle.wait(TIMEOUT_S) == 255 and "lost" in (handle.error or "")
        return int(lines[0].split()[1]), handle.pgid

    child, pgid = on_first(cluster, go)
    assert asyncio.run(wait_until(lambda: not pid_alive(child) and not pid_alive(pgid), 15.0)), \
        "processes outlived their SSH connection"


def test_put_and_get_trees_with_remote_tilde(cluster, tmp_path) -> None:
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "a.txt").write_text("A")
    (src / "sub" / "b.bin").write_bytes(bytes(range(256)) * 64)
    (src / "run.sh").write_text("#!/bin/sh\necho ran\n")
    (src / "run.sh").chmod(0o755)
    remote = f"~/vpsc-test-{tmp_path.name}/deep/dst"

    async def go(ex):
        await ex.put(str(src), remote)
        ran = await ex.run(f"{remote}/run.sh", TIMEOUT_S)  # permissions kept
        await ex.get(remote, str(tmp_path / "back"))
        await ex.put(str(src / "a.txt"), f"~/vpsc-test-{tmp_path.name}/single.txt")
        single = await ex.run(f"cat ~/vpsc-test-{tmp_path.name}/single.txt", TIMEOUT_S)
        await ex.run(f"rm -rf ~/vpsc-test-{tmp_path.name}", TIMEOUT_S)
        with pytest.raises(RemoteError, match="node-a: get /nonexistent/x -> .* failed"):
            await ex.get("/nonexistent/x", str(tmp_path / "nothing"))
        return ran, single

    ran, single = on_first(cluster, go)
    assert ran.stdout == "ran\n" and single.stdout == "A"
    assert (tmp_path / "back" / "a.txt").read_text() == "A"
    assert (tmp_path / "back" / "sub" / "b.bin").read_bytes() == bytes(range(256)) * 64


# --- unreachable nodes ------------------------------------------------------------------------


def unreachable_cluster(cluster, port: int, connect_timeout_s: float):
    node = Node(name="node-x", host="127.0.0.1", port=port, user="root", identity_file=cluster.nodes[0].identity_file)
    return dataclasses.replace(cluster, nodes=(node,), head="node-x", connect_timeout_s=connect_timeout_s)


def test_closed_port_gives_a_clear_error_at_once(cluster) -> None:
    port = free_port()  # nothing listens there
    t0 = time.monotonic()
    r = on_first(unreachable_cluster(cluster, port, 5.0), lambda ex: ex.run("true", TIMEOUT_S))
    assert time.monotonic() - t0 < 5.0
    assert r.error == f"node-x: cannot connect to 127.0.0.1:{port}: connection refused; " \
                      "is sshd running there and is the port right?"
    assert r.exit_status is None and not r.timed_out


def test_silent_server_times_out_within_the_connect_timeout(cluster) -> None:
    # A listener that accepts and never says a word: what a dead link or a wedged sshd looks like.
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        port = listener.getsockname()[1]
        t0 = time.monotonic()
        r = on_first(unreachable_cluster(cluster, port, 1.5), lambda ex: ex.run("true", TIMEOUT_S))
        elapsed = time.monotonic() - t0
    assert r.error == f"node-x: cannot connect to 127.0.0.1:{port}: timed out after 1.5 s"
    assert 1.0 < elapsed < 1.5 + 5.0


def test_concurrent_calls_share_one_connect_failure(cluster) -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        t0 = time.monotonic()
        results = on_first(unreachable_cluster(cluster, listener.getsockname()[1], 1.5),
                           lambda ex: asyncio.gather(*(ex.run("true", TIMEOUT_S) for _ in range(4))))
        elapsed = time.monotonic() - t0
    assert all("timed out after 1.5 s" in r.error for r in results)
    assert elapsed < 1.5 + 5.0  # one time-out, not four in a row


def test_passphrase_key_gives_a_clear_error(cluster, tmp_path) -> None:
    import subprocess

    key = tmp_path / "locked_key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "Xq7-secret-phrase", "-C", "", "-f", str(key)], check=True)
    node = dataclasses.replace(cluster.nodes[0], identity_file=str(key))
    r = on_first(dataclasses.replace(cluster, nodes=(node,)), lambda ex: ex.run("true", TIMEOUT_S))
    assert r.error.startswith(f"node-a: cannot load identity_file {key}: ")
    assert "ssh-agent" in r.error and "Xq7-secret-phrase" not in r.error


def descendants(pid: int) -> list[int]:
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return [int(c) for c in children] + [d for c in children for d in descendants(int(c))]


def test_node_gone_dark_after_connecting_gives_an_error_not_a_hang(farm, cluster) -> None:
    import os
    import signal

    cluster = dataclasses.replace(cluster, connect_timeout_s=2.0)

    async def go(ex):
        assert (await ex.run("true", TIMEOUT_S)).ok  # connected; now its sshd stops answering
        frozen = descendants(farm.nodes[0].proc.pid)
        assert frozen
        for pid in frozen:
            os.kill(pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            r = await ex.run("echo hi", 2.0)
            return r, time.monotonic() - t0
        finally:
            for pid in frozen:
                os.kill(pid, signal.SIGCONT)

    r, elapsed = on_first(cluster, go)
    assert r.error == f"node-a: 127.0.0.1:{farm.nodes[0].port} did not open a session within 2 s; " \
                      "the node or its link may be down"
    assert elapsed < 2.0 + 3.0


def test_wrong_key_is_refused_without_showing_the_key(cluster, tmp_path) -> None:
    import subprocess

    other = tmp_path / "other_key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "", "-f", str(other)], check=True)
    node = dataclasses.replace(cluster.nodes[0], identity_file=str(other))
    r = on_first(dataclasses.replace(cluster, nodes=(node,)), lambda ex: ex.run("true", TIMEOUT_S))
    assert r.error.startswith(f"node-a: root@127.0.0.1:{node.port} refused the key {other}")
    secret = "".join(other.read_text().splitlines()[1:-1])
    assert secret[:40] not in r.error


def test_start_on_unreachable_node_raises_one_line(cluster) -> None:
    async def go(ex):
        with pytest.raises(RemoteError, match=r"^node-x: cannot connect to 127\.0\.0\.1:\d+: connection refused"):
            await ex.start("sleep 1")

    on_first(unreachable_cluster(cluster, free_port(), 5.0), go)
