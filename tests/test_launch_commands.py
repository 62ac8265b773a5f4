"""Per-node launch commands: program parsing, quoting, and snapshots of what `--dry-run` prints.

A missing or different snapshot fails; regenerate after an intended change with

    VPSC_UPDATE_SNAPSHOTS=1 .venv/bin/pytest tests/test_launch_commands.py   (see snapshot_check.py)
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from snapshot_check import check_snapshot
from vpscluster.errors import UserError
from vpscluster.launch.commands import (
    LaunchOptions, NodeTarget, Program, build_node_commands, parse_program, relative_script, shell_path,
)

SCRIPTS = Path(__file__).parent / "scripts"


@pytest.mark.parametrize("argv,expected", [
    (["python", "train.py", "--lr", "1"], Program("script", "train.py", ("--lr", "1"))),
    (["python3", "-u", "train.py"], Program("script", "train.py")),
    (["/usr/bin/python3.11", "-m", "pkg.mod", "x"], Program("module", "pkg.mod", ("x",))),
    (["bash", "job.sh", "a"], Program("exec", "bash", ("job.sh", "a"))),
    (["pythonista", "x"], Program("exec", "pythonista", ("x",))),
])
def test_parse_program(argv, expected):
    assert parse_program(argv) == expected


@pytest.mark.parametrize("argv", [[], ["python"], ["python", "-c", "print(1)"], ["python", "-m"]])
def test_parse_program_rejects(argv):
    with pytest.raises(UserError):
        parse_program(argv)


def test_torchrun_args_per_kind():
    assert Program("script", "a.py", ("1",)).torchrun_args() == ["a.py", "1"]
    assert Program("module", "m", ()).torchrun_args() == ["-m", "m"]
    assert Program("exec", "bash", ("x",)).torchrun_args() == ["--no-python", "bash", "x"]


def test_shell_path_keeps_home_expandable_and_quotes_the_rest():
    assert shell_path("~") == '"$HOME"'
    assert shell_path("~/my dir") == '"$HOME"/\'my dir\''
    assert shell_path("/srv/a b") == "'/srv/a b'"


def test_relative_script(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "s.py").write_text("")
    p = relative_script(Program("script", str(tmp_path / "sub" / "s.py"), ("1",)), str(tmp_path))
    assert p == Program("script", "sub/s.py", ("1",))
    with pytest.raises(UserError, match="outside the synced directory"):
        relative_script(Program("script", "/etc/passwd"), str(tmp_path))


def _targets():
    return [
        NodeTarget("fra-1", "203.0.113.10", "/opt/venv/bin/python", "/srv/vps/code/proj", 1, "eth0"),
        NodeTarget("ams-1", "198.51.100.7", "python3", "~/vpscluster/code/proj", 2, "ens3",
                   env=(("PYTHONPATH", "/srv/x y"),)),
        NodeTarget("v6-1", "2001:db8::5", "python3", "/w", 1, None),
    ]


def test_node_commands_snapshot():
    options = LaunchOptions(rdzv_id="fixedid", rdzv_port=29511, join_timeout_s=900, store_timeout_s=120)
    cmds = build_node_commands(_targets(), "ams-1", Program("script", "train.py", ("--epochs", "2")), options)
    check_snapshot("launch_node_commands.json", [c.to_dict() for c in cmds])
    head = cmds[1]
    assert head.is_head and not cmds[0].is_head
    # Everyone rendezvous at the head's address (never a hostname); only the head hosts the store.
    assert all(c.argv[c.argv.index("--rdzv-endpoint") + 1] == "198.51.100.7:29511" for c in cmds)
    assert "is_host=1" in head.argv[head.argv.index("--rdzv-conf") + 1]
    assert "is_host=0" in cmds[0].argv[cmds[0].argv.index("--rdzv-conf") + 1]
    assert "join_timeout=900" in head.argv[head.argv.index("--rdzv-conf") + 1]
    assert cmds[0].env["GLOO_SOCKET_IFNAME"] == "eth0" and cmds[0].env["NCCL_SOCKET_IFNAME"] == "eth0"
    assert "GLOO_SOCKET_IFNAME" not in cmds[2].env  # unknown: never guessed
    assert head.argv[head.argv.index("--nproc-per-node") + 1] == "2"
    assert cmds[0].argv[cmds[0].argv.index("--local-addr") + 1] == "203.0.113.10"


def test_shell_line_round_trips_through_the_shell():
    options = LaunchOptions(rdzv_id="r")
    cmd = build_node_commands(_targets(), "fra-1", Program("script", "t.py", ("a b", "$HOME")), options)[1]
    words = shlex.split(cmd.shell())
    assert words[:2] == ["cd", "$HOME/vpscluster/code/proj"]  # "$HOME" stays for the node's shell
    i = words.index("env")
    assert words[i + 1:i + 1 + len(cmd.env)] == [f"{k}={v}" for k, v in cmd.env.items()]
    assert words[i + 1 + len(cmd.env):] == cmd.argv
    assert cmd.argv[-2:] == ["a b", "$HOME"]


def test_unknown_head_is_a_user_error():
    with pytest.raises(UserError, match="head node 'nope'"):
        build_node_commands(_targets(), "nope", Program("script", "t.py"), LaunchOptions(rdzv_id="r"))


def test_dry_run_cli_snapshot(tmp_path, cli):
    """`vpscluster run --dry-run --json` on a cluster file whose hosts do not exist: nothing is contacted."""
    key = tmp_path / "id_test"
    key.write_text("not a real key\n")
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(
        "head: node-b\n"
        f"defaults: {{identity_file: {key}, python: /opt/venv/bin/python, workdir: /srv/vpscluster}}\n"
        "nodes:\n"
        "  - {name: node-a, host: 203.0.113.10}\n"
        "  - {name: node-b, host: 203.0.113.11, workdir: '~/vpsc'}\n"
    )
    r = cli("run", "--cluster", str(cluster), "--dry-run", "--json", "--rdzv-id", "snap", "--rdzv-port", "29400",
            "--run-dir", str(tmp_path / "runs" / "fixed-run"), "--sync", str(SCRIPTS), "--nproc-per-node", "1",
            "--", "python", "ddp_tutorial.py", "--epochs", "3", timeout=60)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    check_snapshot("launch_dry_run.json", doc)
    assert [n["name"] for n in doc["nodes"]] == ["node-a", "node-b"]
    assert doc["nodes"][1]["head"] and doc["nodes"][1]["cwd"] == "~/vpsc/code/run/scripts"
    assert doc["nodes"][0]["command"].startswith("cd /srv/vpscluster/code/run/scripts && exec env ")


def test_dry_run_text_names_every_node(tmp_path, cli):
    key = tmp_path / "k"
    key.write_text("x")
    cluster = tmp_path / "c.yaml"
    cluster.write_text(f"defaults: {{identity_file: {key}}}\nnodes:\n  - {{name: a, host: 192.0.2.50}}\n")
    r = cli("run", "--cluster", str(cluster), "--dry-run", "--sync", str(SCRIPTS), "--", "python", "ddp_tutorial.py",
            timeout=60)
    assert r.returncode == 0, r.stderr
    assert "# a (192.0.2.50, head)" in r.stdout and "torchrun.py" in r.stdout


def test_run_threads_per_rank_sets_omp_num_threads_on_every_node(tmp_path, cli):
    """`run --threads-per-rank N`: OMP_NUM_THREADS=N in every node's environment (torch's own
    choice without it); a negative N is a one-line error."""
    key = tmp_path / "k"
    key.write_text("x")
    cluster = tmp_path / "c.yaml"
    cluster.write_text(f"defaults: {{identity_file: {key}}}\nnodes:\n  - {{name: a, host: 192.0.2.50}}\n"
                       "  - {name: b, host: 192.0.2.51}\n")
    argv = ["run", "--cluster", str(cluster), "--dry-run", "--json", "--sync", str(SCRIPTS)]
    r = cli(*argv, "--threads-per-rank", "1", "--", "python", "ddp_tutorial.py", timeout=60)
    assert r.returncode == 0, r.stderr
    assert [" OMP_NUM_THREADS=1 " in n["command"] for n in json.loads(r.stdout)["nodes"]] == [True, True]
    r = cli(*argv, "--", "python", "ddp_tutorial.py", timeout=60)
    assert r.returncode == 0, r.stderr
    assert not any("OMP_NUM_THREADS" in n["command"] for n in json.loads(r.stdout)["nodes"])
    r = cli(*argv, "--threads-per-rank", "-2", "--", "python", "ddp_tutorial.py", timeout=60)
    assert r.returncode != 0 and r.stderr.strip().count("\n") == 0 and "threads_per_rank must not be negative" in r.stderr


def test_run_without_command_is_one_line_error(tmp_path, cli):
    key = tmp_path / "k"
    key.write_text("x")
    cluster = tmp_path / "c.yaml"
    cluster.write_text(f"defaults: {{identity_file: {key}}}\nnodes:\n  - {{name: a, host: 192.0.2.50}}\n")
    r = cli("run", "--cluster", str(cluster), "--dry-run", timeout=60)
    assert r.returncode != 0
    assert r.stderr.strip().count("\n") == 0 and "no command given" in r.stderr
    r = cli("run", "--cluster", str(cluster), "--dry-run", "--sync", str(SCRIPTS), "--", "python", "missing.py", timeout=60)
    assert r.returncode != 0 and "missing.py: no such script" in r.stderr


@pytest.mark.parametrize("flags,message", [
    (["--join-timeout", "0"], "--join-timeout must be a positive"),
    (["--rdzv-port", "70000"], "--rdzv-port 70000 is not a port"),
    (["--nproc-per-node", "-1"], "--nproc-per-node must be at least 1"),
])
def test_bad_flags_are_one_line_errors(tmp_path, cli, flags, message):
    key = tmp_path / "k"
    key.write_text("x")
    cluster = tmp_path / "c.yaml"
    cluster.write_text(f"defaults: {{identity_file: {key}}}\nnodes:\n  - {{name: a, host: 192.0.2.50}}\n")
    r = cli("run", "--cluster", str(cluster), "--dry-run", *flags, "--", "python", "x.py", timeout=60)
    assert r.returncode == 2 and message in r.stderr and r.stderr.strip().count("\n") == 0, r.stderr


LISTENERS_SCRIPT = """\
import json, os, re, subprocess
agent = os.getppid()
out = subprocess.run(["ss", "-Hltnp"], capture_output=True, text=True, timeout=30).stdout
print("LISTENERS " + json.dumps([line.split()[3] for line in out.splitlines() if re.search(rf"pid={agent},", line)]))
"""


def test_the_agent_stores_listen_only_on_the_address_given(tmp_path):
    """torch's TCPStore server listened on every interface whatever --rdzv-endpoint and
    --local-addr said (0.0.0.0 / [::]): the head's rendezvous store and the store rank 0's agent
    shares with its workers. A real one-node launch, as a node runs it: every socket the agent
    listens on is on the node's own address."""
    import json
    import socket
    import subprocess
    import sys

    (tmp_path / "listeners.py").write_text(LISTENERS_SCRIPT)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    target = NodeTarget("solo", "127.0.0.1", sys.executable, str(tmp_path), 1, None)
    cmd = build_node_commands([target], "solo", Program("script", "listeners.py"),
                              LaunchOptions(rdzv_id="bound", rdzv_port=port, join_timeout_s=60, store_timeout_s=60))[0]
    r = subprocess.run(cmd.shell(), shell=True, capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    found = [json.loads(line.split("LISTENERS ", 1)[1]) for line in r.stdout.splitlines() if "LISTENERS " in line]
    assert found, r.stdout[-2000:] + r.stderr[-2000:]
    listeners = found[0]
    assert f"127.0.0.1:{port}" in listeners, listeners  # the rendezvous store, where it was asked for
    assert listeners and all(a.startswith("127.0.0.1:") for a in listeners), listeners


def _three_node_file(tmp_path):
    key = tmp_path / "k"
    key.write_text("x")
    cluster = tmp_path / "c3.yaml"
    cluster.write_text(f"defaults: {{identity_file: {key}}}\nnodes:\n"
                       + "".join(f"  - {{name: n{i}, host: 192.0.2.{50 + i}}}\n" for i in range(3)))
    return cluster


def test_run_recovery_flags_as_train_defaults_and_refusals(tmp_path, cli):
    """`run --max-restarts/--min-nodes`: on by default on a cluster (train's defaults and line),
    off with --max-restarts 0 and on the local cluster; --min-nodes above the nodes: one line."""
    from vpscluster.launch.recovery import default_min_nodes, default_restarts

    cluster = _three_node_file(tmp_path)
    base = ("run", "--cluster", str(cluster), "--dry-run", "--json", "--sync", str(SCRIPTS))
    on = json.loads(cli(*base, "--", "python", "ddp_tutorial.py", timeout=60).stdout)
    assert on["recovery"] == {"max_restarts": default_restarts(3), "min_nodes": default_min_nodes(3), "nodes": 3,
                              "by_default": True}
    assert any(n.startswith("recovery: on (") for n in on["notes"]), on["notes"]
    given = json.loads(cli(*base, "--max-restarts", "1", "--min-nodes", "3", "--", "python", "ddp_tutorial.py",
                           timeout=60).stdout)
    assert given["recovery"] == {"max_restarts": 1, "min_nodes": 3, "nodes": 3, "by_default": False}
    off = json.loads(cli(*base, "--max-restarts", "0", "--", "python", "ddp_tutorial.py", timeout=60).stdout)
    assert off["recovery"]["max_restarts"] == 0 and "recovery: off (--max-restarts 0" in " ".join(off["notes"])
    local = json.loads(cli("run", "--nodes", "2", "--dry-run", "--json", "--", "python", "tests/scripts/ddp_tutorial.py",
                           cwd=str(SCRIPTS.parents[1]), timeout=60).stdout)
    assert local["recovery"]["max_restarts"] == 0 and "the local cluster has no node to lose" in " ".join(local["notes"])
    r = cli(*base, "--min-nodes", "4", "--", "python", "ddp_tutorial.py", timeout=60)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "--min-nodes 4 is more than the 3 nodes of the cluster; give at most 3" in r.stderr, r.stderr
    r = cli(*base, "--max-restarts", "-1", "--", "python", "ddp_tutorial.py", timeout=60)
    assert r.returncode == 2 and "must not be negative" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_run_collective_timeout_reaches_the_session_settings(tmp_path):
    from vpscluster.cli.run import add_arguments, session_settings
    import argparse

    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(["--nodes", "2", "--collective-timeout", "7", "--", "python", "x.py"])
    assert session_settings(args).timeouts.train_collective_s == 7.0
    args = p.parse_args(["--nodes", "2", "--", "python", "x.py"])
    assert session_settings(args).timeouts.train_collective_s == 180.0


def test_train_quorum_dry_run_gives_each_node_its_own_rendezvous_and_replica_group(tmp_path, cli):
    """`train --quorum`: one torchrun per node (its own store on its own address), the replica
    group's environment, the lighthouse on the head's address; nothing is contacted."""
    key = tmp_path / "k"
    key.write_text("x")
    cluster = tmp_path / "c.yaml"
    cluster.write_text(f"head: b\ndefaults: {{identity_file: {key}}}\nnodes:\n  - {{name: a, host: 192.0.2.50}}\n"
                       "  - {name: b, host: 192.0.2.51}\n  - {name: c, host: 192.0.2.52}\n")
    r = cli("train", "--cluster", str(cluster), "--quorum", "--strategy", "diloco", "--sync-every", "5",
            "--wire-dtype", "fp32", "--preset", "tiny", "--run-dir", str(tmp_path / "run"), "--dry-run", "--json",
            timeout=120)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert [n["head"] for n in doc["nodes"]] == [False, True, False]
    for i, n in enumerate(doc["nodes"]):
        argv = n["argv"]
        assert argv[argv.index("--nnodes") + 1] == "1" and argv[argv.index("--nproc-per-node") + 1] == "1"
        assert argv[argv.index("--rdzv-endpoint") + 1].startswith(n["address"] + ":")
        assert "is_host=1" in argv[argv.index("--rdzv-conf") + 1]
        assert n["env"]["VPSC_REPLICA_GROUP"] == f"{i}/3" and n["env"]["VPSC_REPLICA_ADDR"] == n["address"]
        assert n["env"]["TORCHFT_LIGHTHOUSE"] == "http://192.0.2.51:PORT"
    assert any("torchft's lighthouse on b" in note and "at least 2 replica groups" in note for note in doc["notes"])
    r = cli("train", "--quorum", "--strategy", "diloco", "--dry-run", timeout=60)
    assert r.returncode != 0 and "--quorum trains one replica group per node of a cluster file" in r.stderr


def test_run_quorum_dry_run_launches_as_train_quorum_and_refuses_what_cannot_work(tmp_path, cli):
    """`run --quorum` goes through train's quorum launch: one torchrun per node (its own store on
    its own address), the replica group's environment beside the session's settings, the
    lighthouse on the head's address at the run's recovery floor; nothing is contacted. A script
    not on the session API, `--nodes N` and several ranks per node are refused in one line."""
    cluster = _three_node_file(tmp_path)
    base = ("run", "--cluster", str(cluster), "--dry-run", "--json", "--sync", str(SCRIPTS), "--strategy", "diloco",
            "--quorum")
    r = cli(*base, "--", "python", "session_loop.py", "20", "0", timeout=60)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert [n["head"] for n in doc["nodes"]] == [True, False, False]
    for i, n in enumerate(doc["nodes"]):
        argv = n["argv"]
        assert argv[argv.index("--nnodes") + 1] == "1" and argv[argv.index("--nproc-per-node") + 1] == "1"
        assert argv[argv.index("--rdzv-endpoint") + 1].startswith(n["address"] + ":")
        assert "is_host=1" in argv[argv.index("--rdzv-conf") + 1]
        assert argv[-3:] == ["session_loop.py", "20", "0"]
        assert n["env"]["VPSC_REPLICA_GROUP"] == f"{i}/3" and n["env"]["VPSC_REPLICA_ADDR"] == n["address"]
        assert n["env"]["TORCHFT_LIGHTHOUSE"] == "http://192.0.2.50:PORT"
        assert n["env"]["VPSC_SESSION"].endswith("/session.json")  # the session's settings: strategy.quorum
    assert any("torchft's lighthouse on n0" in note and "at least 2 replica groups" in note for note in doc["notes"])
    floor = json.loads(cli(*base, "--min-nodes", "3", "--", "python", "session_loop.py", "20", "0", timeout=60).stdout)
    assert any("at least 3 replica groups" in note for note in floor["notes"]), floor["notes"]
    plain = json.loads(cli(*base[:-1], "--", "python", "session_loop.py", "20", "0", timeout=60).stdout)
    assert plain["nodes"][0]["argv"][plain["nodes"][0]["argv"].index("--nnodes") + 1] == "3"  # one job, no quorum
    assert not any("TORCHFT_LIGHTHOUSE" in n["env"] for n in plain["nodes"])

    for extra, argv, message in [
        ((), ("ddp_tutorial.py",), "--quorum: ddp_tutorial.py does not use the session API; with --quorum every node "
                                   "runs a replica group of its own"),
        (("--nproc-per-node", "2"), ("session_loop.py", "2", "0"), "--quorum runs one rank per node for now"),
    ]:
        r = cli(*base, *extra, "--", "python", *argv, timeout=60)
        assert r.returncode == 2 and "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert message in r.stderr, r.stderr
    r = cli("run", "--nodes", "2", "--strategy", "diloco", "--quorum", "--dry-run", "--", "python", "session_loop.py",
            "2", "0", cwd=str(SCRIPTS), timeout=60)
    assert r.returncode == 2 and "give --cluster FILE instead of --nodes N" in r.stderr, r.stderr
    r = cli(*base[:-3], "--quorum", "--", "python", "session_loop.py", "2", "0", timeout=60)
    assert r.returncode == 2 and "quorum needs --strategy diloco" in r.stderr, r.stderr


def test_the_quorum_refusal_follows_the_scripts_own_modules(tmp_path):
    """A script whose loop lives in a module of its own (beside it, in a package, or imported
    relatively) is on the session API; one that never imports it is not."""
    from vpscluster.launch.script_hints import quorum_refusal, uses_session

    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "loop.py").write_text("from . import inner\n")
    (tmp_path / "pkg" / "inner.py").write_text("import vpscluster.session as vs\n")
    (tmp_path / "main.py").write_text("from pkg.loop import train\ntrain()\n")
    (tmp_path / "helper.py").write_text("from vpscluster.session import start\n")
    (tmp_path / "uses_helper.py").write_text("import helper\n")
    (tmp_path / "plain.py").write_text("import torch.distributed as dist\nimport json\ndist.init_process_group('gloo')\n")
    assert uses_session(tmp_path / "main.py") and uses_session(tmp_path / "uses_helper.py")
    assert uses_session(tmp_path / "plain.py") is False and uses_session(tmp_path / "missing.py") is None
    assert quorum_refusal(tmp_path / "main.py", [tmp_path]) is None
    assert quorum_refusal(tmp_path / "plain.py", [tmp_path]).startswith("--quorum: plain.py does not use the session API")
