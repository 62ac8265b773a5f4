"""LocalExecutor: run, time-outs, streaming, process-group start/stop, file copies."""

from __future__ import annotations

import asyncio
import re
import time
from pathlib import Path

import pytest

from vpscluster.cluster.inventory import local_cluster, open_executors
from vpscluster.cluster.local import copy_path, group_alive
from conftest import pid_alive


def run(coro):
    return asyncio.run(coro)


async def _with_local(fn):
    async with open_executors(local_cluster()) as (ex,):
        return await fn(ex)


def test_run_collects_exit_status_and_both_streams() -> None:
    r = run(_with_local(lambda ex: ex.run("echo out; echo err >&2; exit 3", 10)))
    assert (r.node, r.exit_status, r.stdout, r.stderr, r.timed_out, r.error) == ("local", 3, "out\n", "err\n", False, None)
    assert not r.ok and r.duration_s < 5


def test_reason_is_one_line_for_every_way_a_command_fails() -> None:
    async def go(ex):
        return [await ex.run(cmd, timeout, cwd=cwd) for cmd, timeout, cwd in (
            ("echo first >&2; echo '  last words  ' >&2; echo out; exit 3", 10, None),  # stderr's last line
            ("echo only on stdout; exit 4", 10, None),  # no stderr: stdout's last line
            ("printf '\\n' >&2; exit 5", 10, None),  # nothing said at all: the exit status
            ("sleep 5", 0.5, None),  # the time-out, with how long it ran
            ("true", 10, "/nonexistent/folder"),  # the transport's own error line
        )]

    said, stdout, silent, slow, unstartable = run(_with_local(go))
    assert said.reason() == "last words"
    assert stdout.reason() == "only on stdout"
    assert silent.reason() == "exit status 5"
    assert re.fullmatch(r"timed out after 0\.[5-9] s|timed out after 1(\.\d)? s", slow.reason()), slow.reason()
    assert unstartable.reason() == unstartable.error and "\n" not in unstartable.reason()


def test_run_argv_is_quoted_and_env_cwd_input_apply(tmp_path: Path) -> None:
    async def go(ex):
        argv = await ex.run(["printf", "%s|", "two words", "$HOME"], 10)
        env_cwd = await ex.run("pwd; echo \"$VPSC_X\"", 10, env={"VPSC_X": "a b"}, cwd=str(tmp_path))
        piped = await ex.run("tr a-z A-Z", 10, input="abc\nno newline")
        silent = await ex.run("cat", 10)  # stdin is /dev/null: no hang
        return argv, env_cwd, piped, silent

    argv, env_cwd, piped, silent = run(_with_local(go))
    assert argv.stdout == "two words|$HOME|"
    assert env_cwd.stdout == f"{tmp_path}\na b\n"
    assert piped.stdout == "ABC\nNO NEWLINE"
    assert silent.ok and silent.stdout == ""


def test_run_in_missing_folder_is_an_error_not_an_exception() -> None:
    r = run(_with_local(lambda ex: ex.run("true", 10, cwd="/nonexistent/folder")))
    assert r.exit_status is None and "cannot start the command in /nonexistent/folder" in r.error


def test_timeout_kills_the_whole_group_and_keeps_partial_output() -> None:
    async def go(ex):
        t0 = time.monotonic()
        r = await ex.run("sleep 60 & echo child $!; sleep 60", 1.0)
        return r, time.monotonic() - t0

    r, elapsed = run(_with_local(go))
    assert r.timed_out and r.exit_status is None and not r.ok
    assert elapsed < 5
    child = int(r.stdout.split()[1])
    assert not pid_alive(child)


def test_stream_delivers_lines_as_they_come() -> None:
    seen: list[tuple[float, str, str]] = []

    async def go(ex):
        return await ex.stream("for i in 1 2 3; do echo line$i; sleep 0.3; done; echo bad >&2",
                               lambda s, line: seen.append((time.monotonic(), s, line)), 10)

    r = run(_with_local(go))
    assert r.ok and r.stdout == "line1\nline2\nline3\n" and r.stderr == "bad\n"
    assert [(s, line) for _, s, line in seen] == [("stdout", "line1"), ("stdout", "line2"), ("stdout", "line3"),
                                                  ("stderr", "bad")]
    assert seen[2][0] - seen[0][0] > 0.4  # arrived over time, not all at the end


def test_start_stop_ends_children_too() -> None:
    lines: list[str] = []

    async def go(ex):
        handle = await ex.start("sleep 60 & echo child $!; sleep 60", on_line=lambda s, line: lines.append(line))
        for _ in range(100):
            if lines:
                break
            await asyncio.sleep(0.05)
        child = int(lines[0].split()[1])
        assert pid_alive(child) and group_alive(handle.pgid)
        assert await handle.wait(0.2) is None and handle.returncode is None
        await handle.stop(grace_s=2)
        await handle.stop(grace_s=2)  # safe twice
        return handle, child

    handle, child = run(_with_local(go))
    assert handle.returncode == 143  # SIGTERM, reported as a shell does
    assert not pid_alive(child) and not group_alive(handle.pgid)
    assert "child" in handle.output_tail.text()


def test_term_ignoring_process_is_killed_after_grace() -> None:
    async def go(ex):
        handle = await ex.start("trap '' TERM; echo ready; while :; do sleep 0.1; done")
        await asyncio.sleep(0.5)
        t0 = time.monotonic()
        await handle.stop(grace_s=0.5)
        return handle, time.monotonic() - t0

    handle, elapsed = run(_with_local(go))
    assert handle.returncode == 137 and elapsed < 5


def test_closing_the_executor_stops_what_it_started() -> None:
    async def go():
        async with open_executors(local_cluster()) as (ex,):
            handle = await ex.start("sleep 60")
            await asyncio.sleep(0.2)
        return handle

    handle = run(go())
    assert handle.returncode is not None and not group_alive(handle.pgid)


def test_put_and_get_copy_files_and_trees(tmp_path: Path) -> None:
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "a.txt").write_text("A")
    (src / "sub" / "b.bin").write_bytes(bytes(range(256)))

    async def go(ex):
        await ex.put(str(src), str(tmp_path / "deep" / "dst"))
        await ex.get(str(tmp_path / "deep" / "dst" / "sub" / "b.bin"), str(tmp_path / "back" / "b.bin"))
        await ex.put(str(src / "a.txt"), str(src / "a.txt"))  # same path: a no-op, not an error

    run(_with_local(go))
    assert (tmp_path / "deep" / "dst" / "a.txt").read_text() == "A"
    assert (tmp_path / "back" / "b.bin").read_bytes() == bytes(range(256))
    assert (src / "a.txt").read_text() == "A"


def test_copy_of_missing_source_raises_a_clear_error(tmp_path: Path) -> None:
    from vpscluster.errors import RemoteError

    with pytest.raises(FileNotFoundError):
        copy_path(str(tmp_path / "nothing"), str(tmp_path / "x"))
    with pytest.raises(RemoteError, match="local: put .*nothing .* failed"):
        run(_with_local(lambda ex: ex.put(str(tmp_path / "nothing"), str(tmp_path / "x"))))


def test_free_port_can_be_bound_at_once_on_v4_and_v6() -> None:
    import socket

    from vpscluster.nodeside.free_port import free_port

    port = free_port()
    assert 1024 <= port <= 65535
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))  # free: binding it succeeds
    if socket.has_ipv6:
        try:
            port6 = free_port("::1")
        except OSError:  # a host with IPv6 switched off
            return
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", port6))
