"""Sandbox up/down/status: contract of `up --json`, cleanliness after down, failed ups leave nothing.

What remains of a sandbox is looked up independently of the sandbox code (ip, /proc, files),
so a bug in its own bookkeeping cannot hide a leak.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from sandbox_fixtures import TEST_PREFIX, sandbox_unavailable_reason, ssh_run

pytestmark = pytest.mark.sandbox


def remnants(name: str) -> list[str]:
    """Every trace of sandbox `name` on this machine: namespaces, links, cgroups, files, processes."""
    from vpscluster.cluster.sandbox.state import bridge_name, tag

    found = []
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10).stdout
    found += [f"netns {line.split()[0]}" for line in netns.splitlines() if line.startswith(f"vpsc.{name}.")]
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, timeout=10).stdout
    found += [f"link {line.split(':')[1].strip()}" for line in links.splitlines()
              if bridge_name(name) in line or f"vps{tag(name)}n" in line]
    from vpscluster.cluster.sandbox import cgroup

    for path in (f"{cgroup.parent()}/{name}", f"/var/lib/vpscluster/sandboxes/{name}"):
        if os.path.exists(path):
            found.append(path)
    if os.path.isdir("/etc/netns"):
        found += [f"/etc/netns/{d}" for d in os.listdir("/etc/netns") if d.startswith(f"vpsc.{name}.")]
    state = f"/var/lib/vpscluster/sandboxes/{name}/"
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            zombie = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue
        if state in cmdline and not zombie:
            found.append(f"process {pid}: {cmdline.strip()}")
    return found


@pytest.fixture
def need_sandbox():
    why = sandbox_unavailable_reason()
    if why:
        pytest.skip(f"sandbox unavailable: {why}")


def test_up_json_contract_ssh_and_clean_down(cli, need_sandbox):
    name = f"{TEST_PREFIX}life-{secrets.token_hex(2)}"
    try:
        r = cli("sandbox", "up", "--name", name, "--nodes", "2", "--bandwidth", "50mbit,200mbit", "--cpu", "0.5", "--json", timeout=120)
        assert r.returncode == 0, r.stderr
        doc = json.loads(r.stdout)  # exactly one JSON document on stdout
        assert {"name", "cluster_file", "nodes"} <= doc.keys() and doc["name"] == name
        from vpscluster.cluster.sandbox import cgroup

        assert doc["cgroup"] == cgroup.current().version  # which hierarchy limits the CPU
        assert [n["name"] for n in doc["nodes"]] == ["node-1", "node-2"]
        assert [n["bandwidth_mbit"] for n in doc["nodes"]] == [50.0, 200.0]
        assert [n["cpu"] for n in doc["nodes"]] == [0.5, 0.5]
        for n in doc["nodes"]:
            assert {"name", "address", "namespace", "bandwidth_mbit", "cpu"} <= n.keys()
            assert len({n["address"] for n in doc["nodes"]}) == 2
        # Every piece is where the record says: the kernel sees it, not just the state file.
        from vpscluster.cluster import sandbox

        info = sandbox.info(name)
        for n in info.nodes:
            assert Path(f"/run/netns/{n.namespace}").exists()
            assert "tbf" in subprocess.run(["tc", "qdisc", "show", "dev", n.veth], capture_output=True, text=True).stdout
            quota_us, period_us = (int(Path(n.cgroup, f).read_text()) for f in ("cpu.cfs_quota_us", "cpu.cfs_period_us"))
            assert quota_us / period_us == 0.5
        # A real login with the generated key and strict host-key checking; the node has its own
        # hostname, resolving to its own address, and what runs there lives in its cgroup.
        r2 = ssh_run(info, "node-2", "hostname; getent hosts $(hostname); cat /sys/fs/cgroup/cpu/cpu.cfs_quota_us "
                                     "/sys/fs/cgroup/cpu/cpu.cfs_period_us; sleep 30 >/dev/null 2>&1 & echo $!")
        assert r2.returncode == 0, r2.stderr
        lines = r2.stdout.splitlines()
        assert lines[0] == "node-2"
        assert info.node("node-2").address in lines[1]
        assert int(lines[2]) / int(lines[3]) == 0.5  # the node sees its own share, as in a container
        sleeper = int(lines[4])  # started over ssh, still running: it must be in the node's cgroup
        assert str(sleeper) in Path(info.node("node-2").cgroup, "cgroup.procs").read_text().split()
        # The cluster file is the format the inventory loads.
        from vpscluster.cluster.inventory import load_cluster

        cluster = load_cluster(doc["cluster_file"])
        assert [(n.name, n.host, n.advertised_bandwidth_mbit) for n in cluster.nodes] == [
            ("node-1", info.nodes[0].address, 50.0), ("node-2", info.nodes[1].address, 200.0)]
        assert len({n.workdir for n in cluster.nodes}) == 2 and cluster.nodes[0].labels == {"sandbox": name}
        assert cluster.known_hosts == info.known_hosts and not cluster.accept_new_host_keys

        st = cli("sandbox", "status", "--name", name, "--json")
        rec = json.loads(st.stdout)["sandboxes"][0]
        assert rec["state"] == "up" and all(n["sshd_alive"] for n in rec["nodes"])
        assert remnants(name)  # the check below can see a sandbox when there is one
    finally:
        down = cli("sandbox", "down", "--name", name)
    assert down.returncode == 0, down.stderr
    assert remnants(name) == []
    again = cli("sandbox", "down", "--name", name)
    assert again.returncode == 0 and "nothing to remove" in again.stdout


def test_latency_without_netem_fails_cleanly(cli, need_sandbox):
    from vpscluster.cluster.sandbox.shaping import netem_available

    if netem_available():
        pytest.skip("this kernel has netem; the no-netem error path cannot be exercised here")
    name = f"{TEST_PREFIX}lat-{secrets.token_hex(2)}"
    r = cli("sandbox", "up", "--name", name, "--nodes", "2", "--latency", "20")
    assert r.returncode != 0
    assert "netem" in r.stderr and len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr
    assert remnants(name) == []


def test_up_failing_half_way_removes_what_it_built(monkeypatch, need_sandbox):
    from vpscluster.cluster import sandbox
    from vpscluster.cluster.sandbox import sshd
    from vpscluster.errors import UserError

    real_start = sshd.start
    started = []

    def start_then_fail(namespace, hostname, *args):
        if hostname == "node-2":
            raise UserError("injected: sshd for node-2 failed")
        started.append(real_start(namespace, hostname, *args))
        return started[-1]

    monkeypatch.setattr(sshd, "start", start_then_fail)
    name = f"{TEST_PREFIX}half-{secrets.token_hex(2)}"
    with pytest.raises(UserError, match="injected"):
        sandbox.up(name, nodes=3, bandwidth="100mbit", cpu=0.5)
    assert len(started) == 1  # node-1's sshd was running when it failed ...
    assert remnants(name) == []  # ... and is gone with everything else
    assert not _running(started[0])


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_two_sandboxes_side_by_side(make_sandbox, cli):
    a = make_sandbox(nodes=1, bandwidth="1gbit")
    b = make_sandbox(nodes=1, bandwidth="1gbit")
    assert a.subnet != b.subnet and a.bridge != b.bridge
    assert a.nodes[0].namespace != b.nodes[0].namespace
    assert ssh_run(a, "node-1", "true").returncode == 0 and ssh_run(b, "node-1", "true").returncode == 0
    r = cli("sandbox", "up", "--name", a.name, "--nodes", "1")
    assert r.returncode != 0 and "already exists" in r.stderr
    # Not `down --all` here: other test runs on this machine may have sandboxes up.
    for sb in (a, b):
        r = cli("sandbox", "down", "--name", sb.name, "--json")
        assert r.returncode == 0 and json.loads(r.stdout) == {"removed": [sb.name]}
    assert remnants(a.name) == [] and remnants(b.name) == []


@pytest.mark.parametrize("args, message", [
    (["--name", "Bad_Name"], "name 'Bad_Name' is not valid"),
    (["--nodes", "0"], "--nodes 0 is outside"),
    (["--nodes", "3", "--bandwidth", "10mbit,20mbit"], "2 values given for 3 nodes"),
    (["--bandwidth", "fast"], "is not a rate"),
    (["--cpu", "0"], "--cpu: 0 is outside"),
    (["--cpu", "half"], "is not a CPU share"),
])
def test_bad_input_is_one_line(cli, args, message):
    r = cli("sandbox", "up", *args)
    assert r.returncode != 0 and message in r.stderr and len(r.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("argv", [["up", "--name", "pt-noroot"], ["down", "--name", "pt-noroot"], ["status"], ["down", "--all"], ["down", "--prefix", "pt-"]])
def test_not_root_is_a_clear_error(monkeypatch, capsys, argv):
    from vpscluster.cli import main

    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert main(["sandbox", *argv]) != 0
    err = capsys.readouterr().err
    assert "needs root" in err and len(err.strip().splitlines()) == 1


def test_down_removes_pieces_left_without_a_record(cli, need_sandbox):
    """As if `up` had been killed -9 early: a namespace, a link, a cgroup, a process, no state file."""
    from vpscluster.cluster.sandbox.state import netns_name, veth_name

    name = f"{TEST_PREFIX}orph-{secrets.token_hex(2)}"
    ns, veth = netns_name(name, "node-1"), veth_name(name, 1)
    cg = Path(f"/sys/fs/cgroup/cpu/vpscluster/{name}/node-1")
    try:
        subprocess.run(["ip", "netns", "add", ns], check=True, timeout=10)
        subprocess.run(["ip", "link", "add", veth, "type", "veth", "peer", "name", veth + "p"], check=True, timeout=10)
        cg.mkdir(parents=True)
        sleeper = subprocess.Popen(["ip", "netns", "exec", ns, "sleep", "300"])
        (cg / "cgroup.procs").write_text(str(sleeper.pid))
        st = cli("sandbox", "status", "--json")
        rec = [r for r in json.loads(st.stdout)["sandboxes"] if r["name"] == name]
        assert rec and rec[0]["state"] == "partial"
        assert len(remnants(name)) >= 3
        r = cli("sandbox", "down", "--name", name)
        assert r.returncode == 0 and name in r.stdout
        assert sleeper.wait(timeout=10) == -9  # killed, not left running in a deleted namespace
        assert remnants(name) == []
    finally:
        cli("sandbox", "down", "--name", name)


def test_fixture_skips_with_the_reason_when_not_root(monkeypatch):
    import sandbox_fixtures

    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert "needs root" in sandbox_fixtures.sandbox_unavailable_reason()
    with pytest.raises(pytest.skip.Exception, match="sandbox unavailable: .*needs root"):
        sandbox_fixtures.SandboxFactory()(nodes=1)


def test_names_fit_the_kernel_and_stay_apart():
    from vpscluster.cluster.sandbox import state

    longest = "a" * 24
    assert state.check_name(longest) == longest
    for name in (longest, "x"):
        for i in (1, state.MAX_NODES):
            assert len(state.veth_name(name, i)) <= 15 and len(state.veth_name(name, i).replace("vps", "vpp", 1)) <= 15
        assert len(state.bridge_name(name)) <= 15
    # A name that is a prefix of another never matches the other's namespaces.
    assert not state.netns_name("ab-c", "node-1").startswith(f"{state.NETNS_PREFIX}ab.")
    assert 1 <= state.preferred_subnet_octet("default") <= 254


def test_parallel_ups_get_their_own_subnets(make_sandbox):
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(3) as pool:
        infos = list(pool.map(lambda _: make_sandbox(nodes=1, bandwidth="1gbit"), range(3)))
    assert len({i.subnet for i in infos}) == 3 and len({i.bridge for i in infos}) == 3
    for i in infos:
        assert ssh_run(i, "node-1", "true").returncode == 0


def test_status_reports_a_dead_sshd(make_sandbox, cli):
    import signal

    info = make_sandbox(nodes=2, bandwidth="1gbit")
    pid = int(Path(info.state_dir, "nodes", "node-2", "sshd.pid").read_text())
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while _running(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    rec = json.loads(cli("sandbox", "status", "--name", info.name, "--json").stdout)["sandboxes"][0]
    assert rec["state"] == "degraded"
    assert [n["sshd_alive"] for n in rec["nodes"]] == [True, False]
    table = cli("sandbox", "status", "--name", info.name)
    assert "dead" in table.stdout and "degraded" in table.stdout


def test_down_all_removes_every_sandbox_and_orphan(monkeypatch, need_sandbox):
    """`down --all` (a user's clean slate). Run under a private naming scheme, so that it cannot touch
    the sandboxes of other test runs that share this machine."""
    from vpscluster.cluster import sandbox
    from vpscluster.cluster.sandbox import cgroup, state

    scheme = {"NETNS_PREFIX": "vpst.", "BRIDGE_PREFIX": "vptbr", "VETH_PREFIX": "vpt", "PEER_PREFIX": "vpq"}
    for attr, value in scheme.items():
        monkeypatch.setattr(state, attr, value)
    # Not under /tmp: sshd refuses keys below a world-writable directory (StrictModes).
    private_root = Path(f"/var/lib/vpscluster/test-{secrets.token_hex(3)}")
    monkeypatch.setattr(state, "STATE_ROOT", private_root / "sandboxes")
    monkeypatch.setattr(cgroup, "PARENT_NAME", f"vpscluster-test-{secrets.token_hex(3)}")

    def traces() -> list[str]:
        found = [f"netns {n}" for n in os.listdir("/run/netns") if n.startswith("vpst.")]
        links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, timeout=10).stdout
        found += [f"link {line.split(':')[1].strip()}" for line in links.splitlines()
                  if line.split(":")[1].strip().startswith(("vptbr", "vpt", "vpq"))]
        if cgroup.parent().exists():
            found.append(str(cgroup.parent()))
        if state.STATE_ROOT.exists():
            found += [p.name for p in state.STATE_ROOT.iterdir() if p.name != ".lock"]
        return found

    try:
        a = sandbox.up("all-a", nodes=2, bandwidth="1gbit", cpu=0.5)
        sandbox.up("all-b", nodes=1, bandwidth="1gbit")
        assert a.nodes[0].namespace == "vpst.all-a.node-1" and a.bridge.startswith("vptbr")
        assert ssh_run(a, "node-2", "true").returncode == 0
        # The remains of an `up` killed early: a namespace and a veth pair, no record at all.
        subprocess.run(["ip", "netns", "add", "vpst.lost.node-1"], check=True, timeout=10)
        subprocess.run(["ip", "link", "add", "vptabcdefn1", "type", "veth", "peer", "name", "vpqabcdefn1"], check=True, timeout=10)
        assert len(traces()) > 5
        assert sorted(sandbox.down_all()) == ["all-a", "all-b", "lost"]
        assert traces() == []
        assert sandbox.down_all() == []  # twice is fine
    finally:
        sandbox.down_all()
        shutil.rmtree(private_root, ignore_errors=True)


def test_down_prefix_removes_only_the_sandboxes_it_names(make_sandbox, cli):
    """What tests and CI clean up with: `down --prefix` leaves every other sandbox alone."""
    run = f"{TEST_PREFIX}pfx{secrets.token_hex(2)}"
    mine = make_sandbox(nodes=1, bandwidth="1gbit", name=f"{run}-a")
    other = make_sandbox(nodes=1, bandwidth="1gbit", name=f"{TEST_PREFIX}keep{secrets.token_hex(2)}")
    r = cli("sandbox", "down", "--prefix", run, "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == {"removed": [mine.name]}
    assert remnants(mine.name) == []
    assert ssh_run(other, "node-1", "true").returncode == 0  # untouched
    assert "nothing to remove" in cli("sandbox", "down", "--prefix", run).stdout


@pytest.mark.parametrize("prefix", ["", "Bad*"])
def test_down_prefix_refuses_an_empty_or_bad_prefix(cli, prefix):
    r = cli("sandbox", "down", "--prefix", prefix)
    assert r.returncode != 0 and len(r.stderr.strip().splitlines()) == 1 and "--prefix" in r.stderr, r.stderr
