"""`vpscluster sandbox fault`: every fault observed for real on a 2-node sandbox, through the CLI.

link-down: node-to-node ping fails while it lasts and works after (restored by the detached
timer, the CLI having exited long before); stop: a node's process is in state T, then runs
again; throttle: tc shows the new rate and iperf3 measures it, clear restores it; kill: every
process of the node is gone but its sshd, which still answers; disk-full: writes fail with
ENOSPC, what was there stays, clear makes room again.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fault_helpers import sandbox_name
from sandbox_fixtures import SandboxFactory, ns_popen, ssh_run
from test_sandbox_links import iperf_mbit

pytestmark = pytest.mark.sandbox

VPSCLUSTER = [sys.executable, "-m", "vpscluster"]


@pytest.fixture(scope="module")
def sb():
    factory = SandboxFactory()
    try:
        yield factory(nodes=2, bandwidth="100mbit", name=sandbox_name())
    finally:
        factory.close()


def fault(sb, *args, node="node-2", check=True) -> subprocess.CompletedProcess:
    argv = [*VPSCLUSTER, "sandbox", "fault", "--name", sb.name, *(["--node", node] if node else []), *args]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc


def ping(sb, src: str, dst: str) -> bool:
    """Whether `src` reaches `dst`'s sshd (a TCP handshake within 1 s, from inside src's namespace)."""
    code = f"import socket; socket.create_connection(({sb.node(dst).address!r}, 22), timeout=1).close()"
    argv = ["ip", "netns", "exec", sb.node(src).namespace, sys.executable, "-c", code]
    return subprocess.run(argv, capture_output=True, timeout=10).returncode == 0


def proc_state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return "gone"


def wait_for(pred, timeout_s: float, step: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(step)
    return pred()


def test_link_down_then_back_by_timer(sb):
    assert ping(sb, "node-1", "node-2")
    started = time.monotonic()
    fault(sb, "link-down", "4")  # the CLI exits at once; a detached timer brings the link back
    assert not ping(sb, "node-1", "node-2")
    assert ssh_run(sb, "node-2", "true", timeout_s=30).returncode != 0 or time.monotonic() - started > 4
    assert wait_for(lambda: ping(sb, "node-1", "node-2"), timeout_s=15)
    assert time.monotonic() - started >= 3.5
    from vpscluster.cluster.sandbox import faults

    assert wait_for(lambda: faults.active(sb.name) == [], timeout_s=5)
    assert ssh_run(sb, "node-2", "true").returncode == 0


def test_stop_freezes_processes_but_not_sshd(sb):
    proc = ns_popen(sb, "node-2", ["sleep", "300"])
    try:
        fault(sb, "stop", "2")
        assert proc_state(proc.pid) == "T"
        assert ssh_run(sb, "node-2", "echo alive").stdout.strip() == "alive"  # sshd was spared
        assert wait_for(lambda: proc_state(proc.pid) in ("S", "R"), timeout_s=10)
    finally:
        proc.kill()
        proc.wait(timeout=10)


def test_throttle_measured_and_cleared(sb):
    n = sb.node("node-2")
    fault(sb, "throttle", "5mbit", "60")
    try:
        assert "rate 5Mbit" in subprocess.run(["tc", "qdisc", "show", "dev", n.veth], capture_output=True, text=True).stdout
        measured = iperf_mbit(sb, "node-1", "node-2")
        assert 3.5 < measured < 5.5, measured
    finally:
        out = fault(sb, "clear", node=None, check=True)
    assert "node-2 throttle" in out.stdout
    assert "rate 100Mbit" in subprocess.run(["tc", "qdisc", "show", "dev", n.veth], capture_output=True, text=True).stdout


def test_kill_leaves_only_sshd(sb):
    from vpscluster.cluster.sandbox import faults

    direct = ns_popen(sb, "node-2", ["sleep", "300"])
    remote = ssh_run(sb, "node-2", "nohup setsid sleep 301 >/dev/null 2>&1 & echo $!")
    remote_pid = int(remote.stdout.strip())
    try:
        assert proc_state(remote_pid) != "gone"
        fault(sb, "kill")
        direct.wait(timeout=10)
        assert direct.returncode == -9
        assert proc_state(remote_pid) in ("gone", "Z")
        left = [p for p in faults.node_pids(sb, sb.node("node-2"))]
        assert [Path(f"/proc/{p}/comm").read_text().strip() for p in left] == ["sshd"]
        assert ssh_run(sb, "node-2", "echo back").stdout.strip() == "back"
    finally:
        if direct.poll() is None:
            direct.kill()
            direct.wait(timeout=10)


def test_disk_full_then_clear(sb):
    work = sb.node("node-2").workdir
    assert ssh_run(sb, "node-2", f"echo before > {work}/kept.txt").returncode == 0
    fault(sb, "disk-full")
    try:
        wrote = ssh_run(sb, "node-2", f"cd {work} && head -c 1048576 /dev/zero > big.bin")
        assert wrote.returncode != 0 and "No space left" in wrote.stderr, wrote
        assert Path(work, "kept.txt").read_text() == "before\n"
    finally:
        fault(sb, "clear", node="node-2")
    assert ssh_run(sb, "node-2", f"cd {work} && head -c 1048576 /dev/zero > big.bin && rm big.bin").returncode == 0
    assert os.statvfs(work).f_bavail * os.statvfs(work).f_frsize > 100 * 2**20


def test_cli_errors_are_one_line(sb):
    for args, says in ((["explode"], "unknown kind"), (["stop"], "expected `stop SECONDS`"),
                       (["throttle", "1mbit"], "expected `throttle RATE SECONDS`"), (["stop", "-3"], "outside")):
        proc = fault(sb, *args, check=False)
        assert proc.returncode != 0
        assert len(proc.stderr.strip().splitlines()) == 1 and says in proc.stderr, proc.stderr
    proc = fault(sb, "kill", node="node-9", check=False)
    assert proc.returncode != 0 and "no node 'node-9'" in proc.stderr


def test_clear_ends_a_timed_fault_early_and_stops_its_timer(sb):
    import json

    proc = ns_popen(sb, "node-1", ["sleep", "300"])
    try:
        record = json.loads(fault(sb, "stop", "300", "--json", node="node-1").stdout)
        assert record["kind"] == "stop" and proc.pid in record["stopped"] and record["timer_pid"]
        assert proc_state(proc.pid) == "T"
        cleared = json.loads(fault(sb, "clear", "--json", node=None).stdout)["cleared"]
        assert [f["id"] for f in cleared] == [record["id"]]
        assert proc_state(proc.pid) in ("S", "R")
        assert wait_for(lambda: proc_state(record["timer_pid"]) in ("gone", "Z"), timeout_s=5)
    finally:
        proc.kill()
        proc.wait(timeout=10)


def test_down_leaves_no_fault_timer():
    from vpscluster.cluster import sandbox
    from vpscluster.cluster.sandbox import faults

    factory = SandboxFactory()
    try:
        info = factory(nodes=1, bandwidth="100mbit", name=sandbox_name())
        record = faults.inject(info.name, "node-1", "link-down", seconds=300)
        assert proc_state(record["timer_pid"]) not in ("gone", "Z")  # alive (S, R, or D while it starts)
        sandbox.down(info.name)
        assert wait_for(lambda: proc_state(record["timer_pid"]) in ("gone", "Z"), timeout_s=5)
    finally:
        factory.close()
