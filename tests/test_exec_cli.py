"""`vpscluster exec` as a user runs it: the local cluster, and 3 real sshd nodes plus a dead one."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from cluster_sshd import SSHDFarm, free_port, sshd_unavailable_reason


def needs_sshd(test):
    return pytest.mark.ssh(pytest.mark.skipif(sshd_unavailable_reason() is not None, reason=sshd_unavailable_reason() or "")(test))


# Fails on node-b (exit 7) and sleeps past the time-out on node-c, told apart by the sshd port.
SCRIPT = ('echo "hello from $(hostname)"; echo "to stderr" >&2; '
          'case "$SSH_CONNECTION" in *" {b}") exit 7;; *" {c}") sleep 60;; esac')


def test_exec_without_cluster_runs_on_this_machine(cli) -> None:
    r = cli("exec", "--", "echo hi; exit 0", timeout=60)
    assert r.returncode == 0, r.stderr
    assert re.search(r"^local \| hi$", r.stdout, re.M)
    assert "1/1 nodes succeeded" in r.stdout


def test_exec_json_and_argv_quoting_locally(cli) -> None:
    r = cli("exec", "--json", "--", "python3", "-c", "import sys; print('a b'); sys.exit(4)", timeout=60)
    assert r.returncode == 1
    doc = json.loads(r.stdout)  # exactly one JSON document on stdout
    (res,) = doc["results"]
    assert set(res) == {"node", "exit_status", "stdout", "stderr", "duration_s", "timed_out", "error"}
    assert (res["node"], res["exit_status"], res["stdout"], res["timed_out"]) == ("local", 4, "a b\n", False)
    assert "local | a b" in r.stderr  # live lines and the table go to stderr with --json


def test_exec_needs_a_command(cli) -> None:
    r = cli("exec", timeout=60)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.strip() == "vpscluster exec: error: no command given; put it after --, e.g. vpscluster exec -- hostname"


def test_exec_bad_cluster_file_is_one_line(cli, tmp_path) -> None:
    (tmp_path / "c.yaml").write_text("nodes:\n  - {name: a, host: h, port: 0}\n")
    r = cli("exec", "--cluster", str(tmp_path / "c.yaml"), "--", "true", timeout=60)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip() == f"vpscluster exec: error: {tmp_path / 'c.yaml'}: nodes[0].port: 0 is not a port (1-65535)"


@pytest.fixture(scope="module")
def farm(tmp_path_factory):
    farm = SSHDFarm(tmp_path_factory.mktemp("exec-sshd"), 3)
    yield farm
    farm.stop()


@needs_sshd
def test_exec_on_three_nodes_and_a_dead_one(farm, cli, tmp_path) -> None:
    dead_port = free_port()
    known_hosts = farm.known_hosts(tmp_path / "known_hosts")
    cluster_file = farm.cluster_yaml(
        tmp_path / "cluster.yaml", known_hosts, connect_timeout_s=5,
        extra_nodes=[{"name": "node-d", "host": "127.0.0.1", "port": dead_port}])
    a, b, c = farm.nodes
    script = SCRIPT.format(b=b.port, c=c.port)

    r = cli("exec", "--cluster", str(cluster_file), "--timeout", "4", "--", script, timeout=120)
    assert r.returncode == 1, r.stderr
    out = r.stdout
    for name in ("node-a", "node-b", "node-c"):  # every line carries its node's name
        assert re.search(rf"^{name} \| hello from \S+$", out, re.M), out
        assert re.search(rf"^{name} \| to stderr$", out, re.M), out
    assert re.search(rf"^node-d \| cannot connect to 127\.0\.0\.1:{dead_port}: connection refused", out, re.M)
    rows = {m.group(1): m.group(2) for m in re.finditer(r"^(node-\w)\s+│\s+(\S+)\s+│", out, re.M)}
    assert rows == {"node-a": "0", "node-b": "7", "node-c": "-", "node-d": "-"}, out
    assert "timed out after 4 s" in out and "1/4 nodes succeeded" in out
    assert "__VPSC_PGID__" not in out

    r = cli("exec", "--cluster", str(cluster_file), "--timeout", "4", "--json", "--", script, timeout=120)
    results = {x["node"]: x for x in json.loads(r.stdout)["results"]}
    assert r.returncode == 1
    assert list(results) == ["node-a", "node-b", "node-c", "node-d"]  # the file's order
    assert results["node-a"]["exit_status"] == 0 and results["node-a"]["stdout"].startswith("hello from ")
    assert results["node-a"]["stderr"] == "to stderr\n"
    assert results["node-b"]["exit_status"] == 7 and results["node-b"]["error"] is None
    assert results["node-c"]["timed_out"] is True and results["node-c"]["exit_status"] is None
    assert 3.5 < results["node-c"]["duration_s"] < 30
    assert results["node-d"]["exit_status"] is None and "connection refused" in results["node-d"]["error"]
    assert results["node-d"]["duration_s"] < 5

    key_body = "".join(Path(farm.client_key).read_text().splitlines()[1:-1])
    for chunk in (key_body[i:i + 24] for i in range(0, len(key_body), 24)):
        assert chunk not in r.stdout + r.stderr + out


@needs_sshd
def test_exec_accept_new_host_keys_flag(farm, cli, tmp_path) -> None:
    # (Refusal without the flag is covered in test_cluster_ssh.py and test_sandbox_exec.py.)
    known_hosts = tmp_path / "known_hosts"
    cluster_file = farm.cluster_yaml(tmp_path / "cluster.yaml", known_hosts)
    r = cli("exec", "--cluster", str(cluster_file), "--accept-new-host-keys", "--", "true", timeout=120)
    assert r.returncode == 0, r.stdout
    assert sorted(known_hosts.read_text().splitlines()) == sorted(n.known_hosts_line().strip() for n in farm.nodes)
    r = cli("exec", "--cluster", str(cluster_file), "--", "echo again", timeout=120)
    assert r.returncode == 0 and r.stdout.count("| again") == 3
