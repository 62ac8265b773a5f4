"""`train --detach --controller head` and `run --detach --controller head`: the launcher runs on
the sandbox's head node, so the local side can be SIGKILLed (the command that followed the run)
and the run still finishes; a second local `attach` and `report` reach it over SSH and show it
finished. The head reaches the other node with the cluster's own controller key, never the
user's. Unknown or unreachable controller nodes are one-line errors. The two tests on a plain
2-node sandbox share it (`head2`)."""

from __future__ import annotations

import gzip
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from conftest import pid_alive, processes_mentioning, run_cli
from sandbox_fixtures import SandboxFactory, cluster_file_with, node_run_dir

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def head2():
    """A 2-node sandbox at 1 Gbit/s, shared by the module's tests that need nothing else."""
    factory = SandboxFactory(kind="ctl-")
    try:
        yield factory(nodes=2, bandwidth="1gbit")
    finally:
        factory.close()


@pytest.mark.sandbox
@pytest.mark.slow
def test_detach_to_the_head_outlives_the_local_side(head2, tmp_path):
    info = head2
    corpus = tmp_path / "corpus.txt"
    with gzip.open(REPO / "src" / "vpscluster" / "data" / "kjv.txt.gz", "rt") as f:
        corpus.write_text(f.read(100_000))
    run = tmp_path / "run"
    steps = 20
    start = subprocess.Popen(
        [sys.executable, "-m", "vpscluster", "train", "--cluster", info.cluster_file, "--preset", "tiny",
         "--strategy", "ddp", "--data", str(corpus), "--batch-size", "4", "--max-steps", str(steps),
         "--eval-every", "10", "--checkpoint-every", "10", "--threads-per-rank", "1", "--detach", "--controller", "head",
         "--run-dir", str(run), "--json"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    out, err = start.communicate(timeout=120)
    assert start.returncode == 0, err[-3000:]
    doc = json.loads(out)
    head = info.nodes[0]
    assert doc["controller"] == head.name and doc["remote_run_dir"].startswith(head.workdir + "/")
    pid = doc["pid"]
    # The launcher is a process of the head node (its network namespace), not of this machine.
    assert pid_alive(pid) and os.readlink(f"/proc/{pid}/ns/net") != os.readlink("/proc/self/ns/net")
    state = json.loads((run / "launcher.json").read_text())
    assert state["controller"] == head.name and state["remote_run_dir"] == doc["remote_run_dir"]

    # What the head was given: the cluster's controller key (not the user's), known_hosts for
    # the nodes, a cluster file that uses them.
    support = Path(state["remote_cwd"])
    key = Path(info.cluster_file).parent / ".vpscluster" / (Path(info.cluster_file).stem + ".controller_ed25519")
    assert (support / "id_ed25519").read_bytes() == key.read_bytes() != Path(info.identity_file).read_bytes()
    shipped = yaml.safe_load((support / "cluster.yaml").read_text())
    assert {n["identity_file"] for n in shipped["nodes"]} == {str(support / "id_ed25519")}
    assert shipped["known_hosts"] == str(support / "known_hosts")
    # and the probe this side just took, beside that file: the head's launcher takes no second one
    assert json.loads((support / ".vpscluster" / "cluster.probe.json").read_text())["nodes"]

    # The local side goes: a follower SIGKILLed while the run trains (the starter already returned).
    follower = subprocess.Popen([sys.executable, "-m", "vpscluster", "attach", str(run)], stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, text=True, start_new_session=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
    first = follower.stdout.readline()
    assert first, "attach printed nothing"
    os.killpg(follower.pid, signal.SIGKILL)
    follower.wait(timeout=10)
    assert processes_mentioning(str(run)) == []  # nothing of the run left on this machine
    assert pid_alive(pid)  # and the launcher on the head goes on

    t0 = time.monotonic()
    done = run_cli("attach", str(run), timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"step {steps}: validation loss" in done.stdout and "exit status 0" in done.stderr, done.stdout[-2000:]
    assert "running a quick one" not in Path(state["remote_log"]).read_text()
    assert time.monotonic() - t0 < 90

    r = run_cli("report", str(run), timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == str(run / "report.html") and (run / "report.html").stat().st_size > 1000
    report = json.loads((run / "report.json").read_text())
    assert report["steps"] == steps and report["stopped_by"] == "max_steps" and report["world_size"] == 2
    assert len((run / "metrics.jsonl").read_text().splitlines()) >= steps
    assert not pid_alive(pid)

    # Errors, one line each: a node the cluster does not have, a second launcher on the run.
    bad = run_cli("train", "--cluster", info.cluster_file, "--preset", "tiny", "--detach", "--controller", "nope",
                  "--run-dir", str(tmp_path / "other"), timeout=120)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1, bad.stderr
    assert "--controller nope: no node nope" in bad.stderr and not (tmp_path / "other").exists()
    again = run_cli("train", "--resume", str(run), "--max-steps", str(steps + 1), timeout=120)
    assert again.returncode == 2 and f"has its launcher on node {head.name}" in again.stderr, again.stderr



@pytest.mark.sandbox
@pytest.mark.slow
def test_run_detached_to_the_head_outlives_the_local_side(head2, tmp_path):
    """`run --detach --controller head` of a user's folder (a session script given by its
    absolute path, and a likely secret beside it): the folder goes to the head less the secret,
    the head runs `vpscluster run` from that copy; the local side is SIGKILLed while the run
    waits (the script holds its ranks until a file appears); `attach`, `logs`, `report` and
    `stop` reach it on the head, and report.json comes back readable here. `run --resume RUN
    --detach --controller node-2` then continues it there from the nodes' newest checkpoint."""
    info, head, steps = head2, head2.nodes[0], 6
    t0 = time.monotonic()
    proj, go, run = tmp_path / "proj", tmp_path / "go", tmp_path / "run"
    proj.mkdir()
    shutil.copy(REPO / "tests" / "scripts" / "session_steps.py", proj / "steps.py")
    (proj / "id_ed25519").write_text("a key of the user's: never shipped")
    r = run_cli("run", "--cluster", info.cluster_file, "--sync", str(proj), "--nproc-per-node", "1", "--checkpoint-every", "3",
                "--detach", "--controller", "head", "--run-dir", str(run), "--json",
                "--", "python", str(proj / "steps.py"), "--steps", str(steps), "--wait-for", str(go),
                timeout=120, cwd=str(tmp_path))
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads(r.stdout)
    pid = doc["pid"]
    assert doc["controller"] == head.name and pid_alive(pid)
    assert os.readlink(f"/proc/{pid}/ns/net") != os.readlink("/proc/self/ns/net")  # a process of the head
    state = json.loads((run / "launcher.json").read_text())
    assert state["controller"] == head.name and state["command"] == "run"
    support = Path(state["remote_cwd"])
    shipped = support / "code" / "proj"
    assert (shipped / "steps.py").read_bytes() == (proj / "steps.py").read_bytes()
    assert not (shipped / "id_ed25519").exists()
    there = json.loads((Path(state["remote_run_dir"]) / "launcher.json").read_text())["argv"]
    at = there.index("--")
    assert there[:at] == ["run", "--nproc-per-node", "1", "--checkpoint-every", "3", "--cluster", str(support / "cluster.yaml"), "--sync", str(shipped),
                          "--run-dir", state["remote_run_dir"], "--detached-child"], there
    assert there[at + 1:] == ["python", "steps.py", "--steps", str(steps), "--wait-for", str(go)]

    follower = subprocess.Popen([sys.executable, "-m", "vpscluster", "logs", str(run), "--follow"], stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, text=True, start_new_session=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert follower.stdout.readline(), "logs --follow printed nothing"
    os.killpg(follower.pid, signal.SIGKILL)
    follower.wait(timeout=10)
    assert processes_mentioning(str(run)) == []  # nothing of the run left on this machine
    mid = run_cli("report", str(run), timeout=60)
    assert mid.returncode == 0 and f"in progress on {head.name}" in mid.stdout, mid.stdout + mid.stderr
    assert pid_alive(pid)  # the run still waits on the head
    go.write_text("")

    done = run_cli("attach", str(run), timeout=120)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert f"session_steps done: {steps} steps" in done.stdout and "exit status 0" in done.stderr, done.stdout[-2000:]
    rep = run_cli("report", str(run), timeout=60)
    assert rep.returncode == 0 and rep.stdout.strip() == str(run / "report.html"), rep.stderr[-2000:]
    report = json.loads((run / "report.json").read_text())
    assert report["steps"] == steps and report["world_size"] == 2
    assert len((run / "metrics.jsonl").read_text().splitlines()) == steps
    tail = run_cli("logs", str(run), "--tail", "20", timeout=60)
    assert tail.returncode == 0 and f"session_steps done: {steps} steps" in tail.stdout, tail.stdout[-2000:]
    halt = run_cli("stop", str(run), timeout=60)
    assert halt.returncode == 2 and f"its launcher on {head.name} is gone" in halt.stderr, halt.stderr
    assert f"vpscluster run --resume {run} --detach --controller {head.name} --cluster " in halt.stderr, halt.stderr
    assert not pid_alive(pid)
    first = time.monotonic() - t0

    # Continued on the other node: from the nodes' checkpoint of step 6, up to 8 steps in all.
    other = info.nodes[1]
    again = run_cli("run", "--resume", str(run), "--cluster", info.cluster_file, "--sync", str(proj), "--nproc-per-node", "1",
                    "--detach", "--controller", other.name, "--", "python", "steps.py", "--steps", str(steps + 2),
                    timeout=120, cwd=str(tmp_path))
    assert again.returncode == 0, again.stderr[-3000:]
    moved = json.loads((run / "launcher.json").read_text())
    assert moved["controller"] == other.name and moved["previous_controllers"][0]["controller"] == head.name
    assert run_cli("attach", str(run), timeout=120).returncode == 0
    assert run_cli("report", str(run), timeout=60).returncode == 0
    report = json.loads((run / "report.json").read_text())
    assert report["steps"] == steps + 2 and report["resumed_from_step"] == steps, report
    metrics = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(1, steps + 3))  # the history from the head, then node-2's steps
    print(f"run --detach --controller head: {first:.1f} s; resumed on {other.name}: {time.monotonic() - t0 - first:.1f} s")

def test_unreachable_controller_is_one_line(tmp_path):
    """The controller node refuses SSH: one line naming it, and no run dir left behind."""
    key = tmp_path / "k"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True, timeout=30)
    (tmp_path / "c.yaml").write_text(
        f"connect_timeout_s: 3\ndefaults: {{identity_file: {key}, port: 1}}\n"
        "nodes:\n  - {name: a, host: 127.0.0.1}\n  - {name: b, host: 127.0.0.1, port: 2}\n")
    run = tmp_path / "run"
    r = run_cli("train", "--cluster", str(tmp_path / "c.yaml"), "--preset", "tiny", "--strategy", "ddp",
                "--detach", "--controller", "b", "--run-dir", str(run), timeout=120, cwd=str(tmp_path))
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert "controller node b (127.0.0.1) unreachable" in lines[0] and "--controller NODE" in lines[0], lines
    assert not run.exists()
    local = run_cli("train", "--nodes", "2", "--detach", "--controller", "head", "--run-dir", str(run), timeout=120)
    assert local.returncode == 2 and "--controller needs a cluster file" in local.stderr
    plain = run_cli("train", "--nodes", "2", "--controller", "head", "--run-dir", str(run), timeout=120)
    assert plain.returncode == 2 and "goes with --detach" in plain.stderr


@pytest.mark.sandbox
@pytest.mark.slow
def test_the_run_outlives_its_controller_node(tmp_path):
    """Two uneven nodes (a third of a core against one): the split is balanced here before the
    run is shipped (the head starts it as a resume, which keeps the stored split); `report` shows
    the progress mid-run; the head (the controller, and a worker node) is killed; `attach` says so
    and how to go on; `train --resume RUN --detach --controller node-2` continues from the nodes'
    newest checkpoint and the run finishes with its whole history; a controller whose link is
    down is one line."""
    from vpscluster.cluster.sandbox import faults

    factory = SandboxFactory(kind="ctk-")
    try:
        info = factory(nodes=2, bandwidth="1gbit", cpu="1,0.34")
        head, other = info.nodes
        corpus = tmp_path / "corpus.txt"
        with gzip.open(REPO / "src" / "vpscluster" / "data" / "kjv.txt.gz", "rt") as f:
            corpus.write_text(f.read(100_000))
        run, steps = tmp_path / "run", 30
        r = run_cli("train", "--cluster", info.cluster_file, "--preset", "tiny", "--strategy", "ddp", "--data", str(corpus),
                    "--batch-size", "4", "--max-steps", str(steps), "--eval-every", "10", "--checkpoint-every", "10",
                    "--threads-per-rank", "1", "--detach", "--controller", "head", "--run-dir", str(run), timeout=240)
        assert r.returncode == 0, r.stderr[-3000:]
        assert "balance" in r.stdout, r.stdout  # said here, where it was decided
        state = json.loads((run / "launcher.json").read_text())
        local = yaml.safe_load((run / "config.yaml").read_text())["strategy"]
        shipped = yaml.safe_load((Path(state["remote_run_dir"]) / "config.yaml").read_text())["strategy"]
        assert local["balance"] is True and local["micro_batches"] and local == shipped

        # Mid-run: the progress so far, from the controller's record of rank 0's events.
        ckpts = [node_run_dir(n, run) / "checkpoints" for n in (head, other)]
        deadline = time.monotonic() + 180
        while not any(c.glob("step-*/manifest.json") for c in ckpts if c.is_dir()):
            assert time.monotonic() < deadline, "no checkpoint within 180 s"
            time.sleep(0.5)
        mid = run_cli("report", str(run), timeout=120)
        assert mid.returncode == 0, mid.stderr[-2000:]
        assert f"in progress on {head.name}: step " in mid.stdout and f"of {steps}" in mid.stdout, mid.stdout
        assert "last checkpoint at step" in mid.stdout, mid.stdout

        killed_at = time.time()
        faults.inject(info.name, head.name, "kill")  # the controller's node: its launcher and rank(s) gone
        gone = run_cli("attach", str(run), timeout=120)
        assert gone.returncode != 0
        assert f"vpscluster train --resume {run} --detach --controller {head.name}" in gone.stderr, gone.stderr[-2000:]
        halt = run_cli("stop", str(run), timeout=120)
        assert halt.returncode == 2 and f"its launcher on {head.name} is gone" in halt.stderr, halt.stderr
        still = run_cli("train", "--resume", str(run), "--detach", timeout=60)  # no controller: refused, says how
        assert still.returncode == 2 and "--controller NODE" in still.stderr, still.stderr

        t_resume = time.monotonic()
        again = run_cli("train", "--resume", str(run), "--detach", "--controller", other.name, "--json", timeout=240)
        assert again.returncode == 0, again.stderr[-3000:]
        t_resume = time.monotonic() - t_resume
        moved = json.loads((run / "launcher.json").read_text())
        assert moved["controller"] == other.name and moved["previous_controllers"][0]["controller"] == head.name
        twice = run_cli("train", "--resume", str(run), "--detach", "--controller", head.name, timeout=120)
        assert twice.returncode == 2 and f"still runs on {other.name}" in twice.stderr, twice.stderr

        done = run_cli("attach", str(run), timeout=240)
        assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-2000:])
        assert f"step {steps}: validation loss" in done.stdout, done.stdout[-2000:]
        rep = run_cli("report", str(run), timeout=120)
        assert rep.returncode == 0, rep.stderr[-2000:]
        report = json.loads((run / "report.json").read_text())
        assert report["steps"] == steps and report["stopped_by"] == "max_steps" and report["world_size"] == 2
        metrics = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        assert {m["step"] for m in metrics if "loss" in m} >= set(range(1, steps + 1))  # the whole history
        resumed = [json.loads(x) for x in (run / "progress.jsonl").read_text().splitlines()]
        at = next(i for i, e in enumerate(resumed) if e["event"] == "resume")
        assert resumed[at].get("step", 0) >= 10, resumed
        first = next(e for e in resumed[at:] if e["event"] == "step")
        print(f"resume on {other.name}: the command {t_resume:.1f} s; from the kill to the first step there "
              f"{first['t'] - killed_at:.1f} s (step {first['step']}, from the checkpoint of step {resumed[at]['step']})")

        # A controller that does not answer: one line, naming it and the way on. Each command
        # gives up after the cluster file's connect_timeout_s: 1 s here (the sandbox writes 10).
        cluster_file_with(info, info.cluster_file, connect_timeout_s=1)
        faults.inject(info.name, other.name, "link-down", seconds=40)
        t0 = time.monotonic()
        lost = run_cli("attach", str(run), timeout=120)
        lines = lost.stderr.strip().splitlines()
        assert lost.returncode == 2 and len(lines) == 1, lost.stderr
        assert f"controller node {other.name}" in lines[0] and "does not answer" in lines[0]
        assert f"--resume {run} --detach --controller NODE" in lines[0]
        assert time.monotonic() - t0 < 60
        late = run_cli("report", str(run), timeout=120)
        assert late.returncode == 2 and len(late.stderr.strip().splitlines()) == 1, late.stderr
        assert "does not answer" in late.stderr
        faults.clear(info.name)
    finally:
        factory.close()
