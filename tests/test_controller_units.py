"""The pieces of `--controller` that need no node: the key pair made once per cluster file, the
known_hosts lines shipped (hashed entries too, only the cluster's hosts), the cluster file as the
controller node sees it, and the authorized_keys edit (idempotent, in the file sshd names)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from vpscluster.cluster.inventory import cluster_from_mapping, load_cluster
from vpscluster.errors import UserError
from vpscluster.launch import controller


def _host_key(tmp_path: Path, name: str) -> str:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp_path / name)], check=True, timeout=30)
    return " ".join((tmp_path / f"{name}.pub").read_text().split()[:2])


@pytest.fixture
def cluster(tmp_path):
    user_key = tmp_path / "id_user"
    user_key.write_text("not shipped")
    known = tmp_path / "known_hosts"
    known.write_text(f"10.0.0.1 {_host_key(tmp_path, 'h1')}\n[10.0.0.2]:2222 {_host_key(tmp_path, 'h2')}\n"
                     f"10.9.9.9 {_host_key(tmp_path, 'other')}\n")
    subprocess.run(["ssh-keygen", "-q", "-H", "-f", str(known)], check=True, capture_output=True, timeout=30)
    (tmp_path / "c.yaml").write_text(
        "known_hosts: known_hosts\nqueue: {url: nats://10.0.0.1:4222, token_file: tok}\n"
        "defaults: {identity_file: id_user, python: /usr/bin/python3}\n"
        "nodes:\n  - {name: a, host: 10.0.0.1, egress_quota: 2TB/month}\n"
        "  - {name: b, host: 10.0.0.2, port: 2222, workdir: /srv/w}\n")
    (tmp_path / "tok").write_text("secret")
    return load_cluster(tmp_path / "c.yaml")


def test_key_made_once_beside_the_cluster_file(cluster, tmp_path):
    key, pub = controller.ensure_key(cluster)
    assert key == tmp_path / ".vpscluster" / "c.controller_ed25519" and pub.startswith("ssh-ed25519 ")
    assert controller.ensure_key(cluster) == (key, pub)  # not made again
    assert oct(key.stat().st_mode & 0o777) == "0o600"


def test_known_hosts_only_the_clusters_hosts_hashed_entries_too(cluster, tmp_path):
    text = controller.known_hosts_text(cluster)
    lines = text.splitlines()
    assert len(lines) == 2 and all(line.startswith("|1|") for line in lines)  # hashed as the user's file is
    out = tmp_path / "shipped"
    out.write_text(text)
    for pattern, found in (("10.0.0.1", True), ("[10.0.0.2]:2222", True), ("10.9.9.9", False)):
        r = subprocess.run(["ssh-keygen", "-F", pattern, "-f", str(out)], capture_output=True, text=True, timeout=30)
        assert (r.returncode == 0) == found, pattern
    (tmp_path / "known_hosts").write_text("")
    with pytest.raises(UserError, match="holds no host key for a"):
        controller.known_hosts_text(cluster)


def test_cluster_file_as_the_controller_sees_it(cluster, tmp_path):
    doc = controller.node_cluster_doc(cluster, "/w/controller/r")
    assert "queue" not in doc and doc["accept_new_host_keys"] is False
    support = tmp_path / "support"
    support.mkdir()
    (support / "id_ed25519").write_text("k")
    doc = controller.node_cluster_doc(cluster, str(support))
    seen = cluster_from_mapping(doc, "shipped", base_dir=support)
    assert [n.name for n in seen.nodes] == ["a", "b"] and seen.head == "a"
    assert {n.identity_file for n in seen.nodes} == {str(support / "id_ed25519")}
    assert seen.known_hosts == str(support / "known_hosts")
    assert seen.node("b").port == 2222 and seen.node("b").workdir == "/srv/w"
    assert seen.node("a").egress_quota_bytes == cluster.node("a").egress_quota_bytes
    assert {n.python for n in seen.nodes} == {"/usr/bin/python3"}


def test_resolve_node(cluster):
    assert controller.resolve_node(cluster, "head").name == "a"
    assert controller.resolve_node(cluster, "b").name == "b"
    with pytest.raises(UserError, match=r"--controller c: no node c in .*c.yaml \(its nodes: a, b; or `head`"):
        controller.resolve_node(cluster, "c")


def test_authorize_is_idempotent_in_the_file_sshd_names(tmp_path):
    keys = tmp_path / "sub" / "authorized_keys"
    pub = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOMqqnkVzrm0SdG6UOoqKLsabgH5C9okWi0dh2l9GKJl vpscluster-controller@c"
    env = {**os.environ, "VPSC_AUTHORIZED_KEYS": str(keys)}
    keys.parent.mkdir()
    keys.write_text("ssh-ed25519 AAAAother user@laptop\n")
    for _ in range(2):
        subprocess.run(["sh", "-c", controller._authorize_command(pub)], env=env, check=True, timeout=30)
    assert keys.read_text().splitlines() == ["ssh-ed25519 AAAAother user@laptop", pub]
    assert oct(keys.stat().st_mode & 0o777) == "0o600"


def test_cluster_file_without_the_nodes_that_do_not_answer(cluster, tmp_path):
    """A resume on another controller leaves out the nodes that do not answer; the head moves."""
    support = tmp_path / "support"
    support.mkdir()
    (support / "id_ed25519").write_text("k")
    doc = controller.node_cluster_doc(cluster, str(support), without=["a"])
    seen = cluster_from_mapping(doc, "shipped", base_dir=support)
    assert [n.name for n in seen.nodes] == ["b"] and seen.head == "b"


def test_no_answer_is_one_line_naming_the_way_on():
    e = controller.no_answer({"controller": "n1", "host": "10.0.0.1", "run_dir": "runs/x"}, "connection refused.")
    text = str(e)
    assert "\n" not in text and text.startswith("controller node n1 (10.0.0.1) does not answer: connection refused;")
    assert text.endswith("vpscluster train --resume runs/x --detach --controller NODE")


def test_progress_so_far_from_the_launchers_record(tmp_path):
    """The detached launcher's record of rank 0's events, and the one line `report` prints mid-run."""
    from vpscluster.launch import detached

    assert detached.progress_line(tmp_path) is None
    sink = detached.progress_sink(tmp_path)
    sink({"event": "start", "world_size": 2})
    sink({"event": "rebalance", "step": 3})  # not recorded: not progress
    for step in (1, 2, 3):
        sink({"event": "step", "step": step, "max_steps": 30, "loss": 5.0 - step, "tokens_per_s": 1000.0})
    sink({"event": "eval", "step": 2, "val_loss": 4.25})
    sink({"event": "checkpoint", "step": 2})
    sink({"event": "end", "report": {"big": "x" * 1000}})
    with (tmp_path / detached.PROGRESS).open("a") as f:
        f.write('{"event": "step", "st')  # a line cut short by a killed launcher
    lines = (tmp_path / detached.PROGRESS).read_text().splitlines()
    assert len(lines) == 8 and "big" not in lines[-2]
    line = detached.progress_line(tmp_path)
    assert line.startswith("step 3 of 30, loss 2.0000, 1000 tokens/s; validation loss 4.2500 at step 2; "
                           "last checkpoint at step 2; updated "), line


def test_a_controller_run_is_continued_on_a_controller(tmp_path):
    """`train --resume` of a run whose launcher is on a node: refused without --controller,
    saying how; with one, left to the controller's own check (launch/controller.py resume)."""
    from vpscluster import fsutil
    from vpscluster.launch import detached

    fsutil.write_json(tmp_path / detached.STATE, {"controller": "n1", "remote_run_dir": "/w/controller-runs/r"})
    with pytest.raises(UserError, match=rf"launcher on node n1.*vpscluster train --resume {tmp_path} --detach --controller NODE"):
        detached.check_free(tmp_path)
    detached.check_free(tmp_path, controller="n2")


# `run --detach --controller NODE`: the command line the controller node runs (cli/detach.py).

def _run_parser():
    from vpscluster.cli import run

    return run.parser()


def test_run_options_rewritten_for_the_controller_in_every_form_argparse_reads(tmp_path):
    """The options the controller gets its own value of go, with their values, however typed
    (`--opt V`, `--opt=V`, an abbreviation); `--sync-every` is not `--sync`; the rest stays as typed."""
    from vpscluster.cli.detach import run_argv_for_controller

    (tmp_path / "train.py").write_text("")
    typed = ["run", "--clu", "c.yaml", "--sync=" + str(tmp_path), "--strategy", "diloco", "--sync-every", "4",
             "--run-dir", "runs/x", "--detach", "--contr", "head", "--json", "--accept-new-host-keys",
             "--time-budget=60", "--no-balance", "--nproc-per-node", "1", "--max-restarts", "0"]
    program = ["--", "python", "-u", str(tmp_path / "train.py"), "--steps", "5", "--sync", "mine"]
    argv = run_argv_for_controller(_run_parser(), typed + program, program, str(tmp_path))("/w/c/cluster.yaml", "/w/c/code/d", "/w/runs/r")
    assert argv == ["run", "--strategy", "diloco", "--sync-every", "4", "--time-budget=60", "--no-balance",
                    "--nproc-per-node", "1", "--max-restarts", "0",
                    "--cluster", "/w/c/cluster.yaml", "--sync", "/w/c/code/d", "--run-dir", "/w/runs/r", "--detach", "--json",
                    "--", "python", "-u", "train.py", "--steps", "5", "--sync", "mine"]  # the script's own --sync stays


def test_the_rewritten_run_reads_as_the_same_session_settings(tmp_path):
    """What NODE's `vpscluster run` parses: the same session and recovery settings and command,
    with the shipped cluster file, folder and run dir."""
    from vpscluster.cli import build_parser
    from vpscluster.cli.detach import run_argv_for_controller
    from vpscluster.cli.run import recovery_settings, session_settings

    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "s.py").write_text("")
    program = ["python", "sub/s.py", "a"]
    typed = ["run", "--cluster", "c.yaml", "--strategy", "diloco", "--sync-every", "8", "--wire-dtype", "int8",
             "--min-nodes", "1", "--detach", "--controller", "n2", *program]
    here = build_parser().parse_args(typed)
    there = build_parser().parse_args(run_argv_for_controller(_run_parser(), typed, program, str(tmp_path))("/c.yaml", "/d", "/r"))
    assert session_settings(there) == session_settings(here) and recovery_settings(there) == recovery_settings(here)
    assert (there.cluster, there.sync, there.run_dir, there.detach, there.json, there.controller) == ("/c.yaml", "/d", "/r", True, True, None)
    assert there.program[-3:] == program


def test_the_program_as_the_controller_runs_it(tmp_path):
    from vpscluster.cli.detach import program_for_controller

    root = tmp_path / "proj"
    (root / "sub").mkdir(parents=True)
    (root / "sub" / "t.py").write_text("")
    (tmp_path / "outside.py").write_text("")
    assert program_for_controller(["--", "python3", str(root / "sub" / "t.py"), "x"], str(root)) == ["python3", "sub/t.py", "x"]
    assert program_for_controller(["python", "./sub/../sub/t.py"], str(root)) == ["python", "sub/t.py"]
    assert program_for_controller(["python", "-m", "pkg.mod", "/abs"], str(root)) == ["python", "-m", "pkg.mod", "/abs"]
    assert program_for_controller(["./job.sh", "/abs"], str(root)) == ["./job.sh", "/abs"]
    for outside in (str(tmp_path / "outside.py"), "../outside.py"):
        with pytest.raises(UserError, match=r"outside\.py is outside the folder .*proj that goes to the controller node; .*--sync DIR"):
            program_for_controller(["python", outside], str(root))


def test_run_on_a_controller_refuses_mistakes_in_one_line_before_anything_starts(tmp_path):
    """A --sync folder that does not exist, a script outside it, a controller not in the cluster
    file, --controller without a cluster file: one line each, no run dir made, no node contacted
    (the cluster's nodes do not exist)."""
    from conftest import run_cli

    key = tmp_path / "k"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True, timeout=30)
    (tmp_path / "c.yaml").write_text(f"connect_timeout_s: 3\ndefaults: {{identity_file: {key}, port: 1}}\n"
                                     "nodes:\n  - {name: a, host: 127.0.0.1}\n  - {name: b, host: 127.0.0.1, port: 2}\n")
    (tmp_path / "proj").mkdir()
    (tmp_path / "proj" / "t.py").write_text("")
    (tmp_path / "elsewhere.py").write_text("")
    run = tmp_path / "run"
    base = ["run", "--cluster", str(tmp_path / "c.yaml"), "--run-dir", str(run), "--detach"]
    cases = [
        (["--controller", "a", "--sync", str(tmp_path / "nope"), "--", "python", "t.py"], "--sync " + str(tmp_path / "nope") + ": not a folder"),
        (["--controller", "a", "--sync", str(tmp_path / "proj"), "--", "python", str(tmp_path / "elsewhere.py")], "is outside the synced directory"),
        (["--controller", "a", "--sync", str(tmp_path / "proj"), "--", "python", "../elsewhere.py"], "is outside the folder"),
        (["--controller", "zz", "--sync", str(tmp_path / "proj"), "--", "python", "t.py"], "--controller zz: no node zz in"),
    ]
    for extra, expected in cases:
        r = run_cli(*base, *extra, timeout=120, cwd=str(tmp_path))
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1 and expected in lines[0], (extra, r.stderr)
        assert not run.exists()
    local = run_cli("run", "--nodes", "2", "--detach", "--controller", "head", "--run-dir", str(run), "--", "python", "t.py",
                    timeout=120, cwd=str(tmp_path / "proj"))
    assert local.returncode == 2 and "--controller needs a cluster file" in local.stderr and not run.exists(), local.stderr


def test_a_run_is_continued_with_run_resume_and_its_command(tmp_path):
    """How to go on once a controller's launcher is gone: `train --resume`, or for a `run` its own
    `run --resume` with the cluster file and the command it ran; check_free says the same."""
    from vpscluster import fsutil
    from vpscluster.cli.detach import run_argv_for_controller
    from vpscluster.launch import detached

    state = {"controller": "n1", "command": "run", "cluster": "/c/c.yaml",
             "argv": ["run", "--cluster", "c.yaml", "--detach", "--controller", "n1", "--", "python", "my train.py", "-x"]}
    assert controller.continue_command(state, "runs/r", "n2") == \
        "vpscluster run --resume runs/r --detach --controller n2 --cluster /c/c.yaml -- python 'my train.py' -x"
    assert controller.continue_command({"controller": "n1"}, "runs/r") == "vpscluster train --resume runs/r --detach --controller NODE"
    fsutil.write_json(tmp_path / detached.STATE, state)
    with pytest.raises(UserError, match=r"vpscluster run --resume .* --detach --controller NODE --cluster /c/c.yaml -- python"):
        detached.check_free(tmp_path)
    (tmp_path / "t.py").write_text("")
    typed = ["run", "--resume", "runs/r", "--cluster", "c.yaml", "--detach", "--controller", "n2", "--", "python", "t.py"]
    argv = run_argv_for_controller(_run_parser(), typed, typed[-3:], str(tmp_path), resume=True)("/c", "/d", "/w/r")
    assert argv == ["run", "--cluster", "/c", "--sync", "/d", "--resume", "/w/r", "--detach", "--json", "--", "python", "t.py"]
