"""Launch across a real 3-node sandbox (network namespaces, sshd per node, shaped links).

`vpscluster train --cluster` completes and learns; a plain DDP tutorial script runs unchanged
through `vpscluster run` and every rank ends with identical weights; a failing rank is named
with its error and nothing is left running; SIGINT to the launcher leaves no training process
on any node within 15 s; a node whose sshd is down fails the launch within the time-out, named;
a session script run by `run` goes on without a node killed mid-run, from its checkpoint.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from sandbox_fixtures import cluster_file_with, node_run_dir

pytestmark = [pytest.mark.sandbox, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "tests" / "scripts"


def ns_processes(namespace: str) -> list[str]:
    """Command lines of the processes in a node's network namespace, sshd itself excluded."""
    out = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True, timeout=10).stdout
    found = []
    for pid in out.split():
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
            comm = Path(f"/proc/{pid}/comm").read_text().strip()
        except OSError:
            continue
        if comm != "sshd" and cmd:
            found.append(f"{pid} {cmd[:160]}")
    return found


def training_leftovers(info) -> dict[str, list[str]]:
    return {n.name: [p for p in ns_processes(n.namespace) if "python" in p or "torch" in p] for n in info.nodes}


def test_train_cluster_completes_and_learns(sandbox3, cli, tmp_path):
    corpus = tmp_path / "corpus.txt"
    with gzip.open(REPO / "src" / "vpscluster" / "data" / "kjv.txt.gz", "rt") as f:
        corpus.write_text(f.read(400_000))
    run_dir = tmp_path / "run"
    # One thread per rank: the sandbox's three nodes share this machine's 2 cores (real nodes have their own).
    r = cli("train", "--cluster", sandbox3.cluster_file, "--max-steps", "16", "--eval-every", "8", "--threads-per-rank", "1",
            "--data", str(corpus), "--run-dir", str(run_dir), "--json", timeout=400)
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads(r.stdout)
    assert report["world_size"] == 3 and report["steps"] == 16
    assert len(report["bytes_sent"]) == 3 and all(b > 0 for b in report["bytes_sent"])
    # Three nodes, one model: every rank's final weights hash alike (not merely losses that differ).
    assert [r["model_sha256"] for r in report["per_rank"]] == [report["model_sha256"]] * 3
    # report.json and metrics.jsonl were fetched into the local run directory.
    assert json.loads((run_dir / "report.json").read_text())["world_size"] == 3
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    vals = [m["val_loss"] for m in metrics if m.get("val_loss") is not None]
    assert len(vals) >= 2 and vals[-1] < vals[0] - 0.5, vals
    # Each node's output is kept in its own log, lines tagged with node/rank.
    logs = {n.name: (run_dir / "logs" / f"{n.name}.log").read_text() for n in sandbox3.nodes}
    assert all(re.search(rf"{name}/\d+ ", text) for name, text in logs.items())
    assert sum("VPSC_EVENT" in t for t in logs.values()) == 1  # rank 0 only
    # Every node trained from the node-side config, with the data path rewritten for it.
    node_cfg = yaml.safe_load((node_run_dir(sandbox3.nodes[1], run_dir) / "config.yaml").read_text())
    assert node_cfg["data"].endswith("corpus.txt")
    assert training_leftovers(sandbox3) == {n.name: [] for n in sandbox3.nodes}


def test_diloco_keeps_the_egress_quota_written_in_the_cluster_file(sandbox3, cli, tmp_path):
    from vpscluster.cluster.inventory import load_cluster
    from vpscluster.config import build
    from vpscluster.plan import auto
    from vpscluster.probe.store import probe_path
    from vpscluster.train.config import TrainConfig

    # 40 steps of `tiny` on 3 ranks at H = 10: 4 syncs of 1.39 MB per rank in int8, 2.8 MB in
    # bf16, 5.6 MB in fp32: 5.6, 11.1 and 22.3 MB over the run. 8 MB a month fits int8 only.
    doc = yaml.safe_load(Path(sandbox3.cluster_file).read_text())
    for node in doc["nodes"]:
        node["egress_quota"] = "8MB/month"
    quota_file = tmp_path / "cluster.yaml"
    quota_file.write_text(yaml.safe_dump(doc))
    # The same nodes: the probe an earlier run of this module saved beside the sandbox's cluster
    # file (`.vpscluster/`) goes with the copy, so pre-flight does not probe them again (a quota
    # is the cluster file's, not the probe's).
    probe = probe_path(load_cluster(sandbox3.cluster_file))
    if probe.exists():
        shutil.copy(probe, probe_path(load_cluster(str(quota_file))))
    cfg = build(TrainConfig, {"preset": "tiny", "strategy": {"name": "diloco"}, "max_steps": 40,
                              "cluster": str(quota_file)})
    model, res, eff = auto.plan_inputs(cfg, load_cluster(sandbox3.cluster_file), None)
    free = auto.plan_diloco(cfg, model, res, eff.value, given=set())
    assert free.sync_every == 10 and free.wire_dtype in ("fp32", "bf16")  # without the quota
    r = cli("train", "--cluster", str(quota_file), "--preset", "tiny", "--strategy", "diloco", "--max-steps", "40",
            "--eval-every", "20", "--threads-per-rank", "1", "--run-dir", str(tmp_path / "run"), "--json", timeout=400)
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads(r.stdout)
    d = report["strategy_details"]
    assert (d["sync_every"], d["wire_dtype"], d["outer_syncs"]) == (10, "int8", 4)
    assert "egress quota allows" in report["strategy_planned"]["reason"]
    # What each rank sent in its collectives stays within its node's quota.
    assert len(report["bytes_sent"]) == 3 and all(0 < b <= 8e6 for b in report["bytes_sent"]), report["bytes_sent"]


def test_plain_ddp_script_runs_unchanged_with_identical_weights(sandbox3, cli, tmp_path):
    run_dir = tmp_path / "run"
    # One torch thread per rank (OMP_NUM_THREADS): the three nodes share this machine's 2 cores.
    r = cli("run", "--cluster", sandbox3.cluster_file, "--json", "--run-dir", str(run_dir), "--sync", str(SCRIPTS),
            "--threads-per-rank", "1", "--", "python", "ddp_tutorial.py", "--epochs", "2", timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads(r.stdout)
    assert doc["ok"] and [n["exit_status"] for n in doc["nodes"]] == [0, 0, 0]
    hashes = {}
    for n in sandbox3.nodes:
        for m in re.finditer(r"STATE_SHA256 rank=(\d+) world=(\d+) ([0-9a-f]{64})", (run_dir / "logs" / f"{n.name}.log").read_text()):
            assert m.group(2) == "3"
            hashes[int(m.group(1))] = m.group(3)
    assert sorted(hashes) == [0, 1, 2]
    assert len(set(hashes.values())) == 1, hashes
    assert training_leftovers(sandbox3) == {n.name: [] for n in sandbox3.nodes}


def test_failing_rank_is_named_and_nothing_is_left(sandbox3, cli, tmp_path):
    run_dir = tmp_path / "run"
    t0 = time.monotonic()
    r = cli("run", "--cluster", sandbox3.cluster_file, "--run-dir", str(run_dir), "--sync", str(SCRIPTS),
            "--threads-per-rank", "1", "--", "python", "fail_on_rank.py", "--rank", "2", "--hang", timeout=300)
    assert r.returncode == 1
    # The node that ran rank 2 is named, with the last line of rank 2's traceback.
    culprit = next(n.name for n in sandbox3.nodes if "/2 " in (run_dir / "logs" / f"{n.name}.log").read_text())
    last = r.stderr.strip().splitlines()[-1]
    assert f"node {culprit} failed" in last and "RuntimeError: deliberate failure on rank 2" in last, last
    assert time.monotonic() - t0 < 120  # the others were hanging: stopped, not waited for
    assert training_leftovers(sandbox3) == {n.name: [] for n in sandbox3.nodes}


def test_sync_copies_over_ssh_by_content_hash(sandbox3, tmp_path):
    """The copy path on real SSH nodes (the sandbox shares its file system, so force a copy)."""
    from vpscluster.cluster.inventory import load_cluster, open_executors
    from vpscluster.launch.sync import file_hash, sync_dir

    async def go():
        async with open_executors(load_cluster(sandbox3.cluster_file)) as executors:
            first = await asyncio.gather(*(sync_dir(ex, str(SCRIPTS), f"{ex.node.workdir}/code/copy-{tmp_path.name}",
                                                    detect_shared=False) for ex in executors))
            again = await asyncio.gather(*(sync_dir(ex, str(SCRIPTS), f"{ex.node.workdir}/code/copy-{tmp_path.name}",
                                                    detect_shared=False) for ex in executors))
            return first, again

    first, again = asyncio.run(go())
    assert all(r.changed == r.files > 0 for r in first)
    assert all(r.changed == 0 for r in again)
    for n in sandbox3.nodes:
        copied = Path(n.workdir, "code", f"copy-{tmp_path.name}", "ddp_tutorial.py")
        assert file_hash(str(copied)) == file_hash(str(SCRIPTS / "ddp_tutorial.py"))


def test_sigint_stops_every_process_on_every_node(sandbox3, tmp_path):
    run_dir = tmp_path / "run"
    # One thread per rank: the three nodes share this machine's 2 cores (no speed figure is checked).
    proc = subprocess.Popen(
        [sys.executable, "-m", "vpscluster", "train", "--cluster", sandbox3.cluster_file, "--max-steps", "5000",
         "--threads-per-rank", "1", "--run-dir", str(run_dir)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and proc.poll() is None:
            logs = list((run_dir / "logs").glob("node-*.log")) if (run_dir / "logs").exists() else []
            if any('"event":"step"' in p.read_text() for p in logs):
                break
            time.sleep(0.5)
        assert proc.poll() is None, proc.stderr.read()[-2000:]
        assert any(training_leftovers(sandbox3).values())  # training really runs on the nodes
        sent = time.monotonic()
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
        # Within 15 s of the signal nothing of the run remains on any node.
        while training_leftovers(sandbox3) != {n.name: [] for n in sandbox3.nodes} and time.monotonic() - sent < 15:
            time.sleep(0.25)
        assert training_leftovers(sandbox3) == {n.name: [] for n in sandbox3.nodes}
        assert time.monotonic() - sent < 15
        assert proc.returncode == 130
        assert "interrupted" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()


def test_node_with_sshd_down_fails_within_timeout_naming_it(make_sandbox, cli, tmp_path):
    info = make_sandbox(nodes=2, bandwidth="100mbit")
    doc = yaml.safe_load(Path(info.cluster_file).read_text())
    doc["connect_timeout_s"] = 5
    doc["command_timeout_s"] = 30
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(yaml.safe_dump(doc, sort_keys=False))
    victim = info.nodes[1]
    for line in subprocess.run(["ip", "netns", "pids", victim.namespace], capture_output=True, text=True).stdout.split():
        if Path(f"/proc/{line}/comm").read_text().strip() == "sshd":
            os.kill(int(line), signal.SIGKILL)
    t0 = time.monotonic()
    r = cli("run", "--cluster", str(cluster), "--sync", str(SCRIPTS), "--", "python", "ddp_tutorial.py", timeout=120)
    elapsed = time.monotonic() - t0
    assert r.returncode != 0
    err = r.stderr.strip().splitlines()
    assert len(err) == 1 and victim.name in err[0], r.stderr
    assert elapsed < 5 + 30 + 15, elapsed
    assert not any(training_leftovers(info).values())


def test_train_from_copied_code_and_data_when_nothing_is_shared(sandbox3, tmp_path):
    """As on real VPS nodes: package and data copied to each workdir, config paths rewritten."""
    from vpscluster.cluster.inventory import load_cluster
    from vpscluster.config import build
    from vpscluster.launch.pipeline import launch
    from vpscluster.launch.train import training_job
    from vpscluster.train import rundir
    from vpscluster.train.config import TrainConfig

    corpus = tmp_path / "corpus.txt"
    with gzip.open(REPO / "src" / "vpscluster" / "data" / "kjv.txt.gz", "rt") as f:
        corpus.write_text(f.read(200_000))
    cfg = build(TrainConfig, {"max_steps": 3, "eval_every": 3, "threads_per_rank": 1, "data": str(corpus),
                              "cluster": sandbox3.cluster_file})
    run_dir = rundir.create(tmp_path / "copied")
    rundir.write_config(cfg, run_dir)
    lines, events = [], []
    job = training_job(cfg, run_dir, load_cluster(sandbox3.cluster_file), say=lines.append, on_event=events.append)
    job.detect_shared = False
    result = launch(job)
    assert result.ok, (result.error, lines[-20:])
    assert [e["event"] for e in events][0] == "start" and events[-1]["event"] == "end"
    assert json.loads((run_dir / "report.json").read_text())["world_size"] == 3
    for n, outcome in zip(sandbox3.nodes, result.nodes):
        code, data = outcome.sync
        assert not code["shared"] and code["remote_path"] == f"{n.workdir}/code/src/vpscluster"
        assert not data["shared"] and Path(n.workdir, "data", "corpus.txt").read_text() == corpus.read_text()
        node_cfg = yaml.safe_load(Path(n.workdir, "runs", "copied", "config.yaml").read_text())
        assert node_cfg["data"] == f"{n.workdir}/data/corpus.txt"
        # The workers imported the copy (Python cached its bytecode there), not the launcher's tree.
        assert list(Path(n.workdir, "code", "src", "vpscluster", "train", "__pycache__").glob("worker.*.pyc"))
    assert training_leftovers(sandbox3) == {n.name: [] for n in sandbox3.nodes}


def test_run_ships_the_script_but_not_the_secrets_beside_it(sandbox3, tmp_path):
    """`vpscluster run` from a folder holding an SSH key, an env file, a .ssh/ and a PEM key beside
    the script, nothing shared (as on real VPS nodes): the script reaches every node and runs,
    none of the secrets does, and one line says what was left out."""
    from vpscluster.cluster.inventory import load_cluster
    from vpscluster.launch.pipeline import launch
    from vpscluster.launch.run import script_job

    proj = tmp_path / f"proj-{tmp_path.name}"
    (proj / ".ssh").mkdir(parents=True)
    (proj / ".ssh" / "config").write_text("Host *\n")
    (proj / "show.py").write_text("import os\nprint('FILES', sorted(os.listdir('.')), flush=True)\n")
    for name, text in (("id_ed25519", "-----BEGIN OPENSSH PRIVATE KEY-----"), (".env", "TOKEN=s3cret"),
                       ("key.pem", "-----BEGIN PRIVATE KEY-----")):
        (proj / name).write_text(text + "\n")
    lines = []
    job = script_job(load_cluster(sandbox3.cluster_file), ["python", "show.py"], sync=str(proj),
                     run_dir=str(tmp_path / "run"), say=lines.append)
    job.detect_shared = False
    result = launch(job)
    assert result.ok, (result.error, lines[-20:])
    said = [line for line in lines if line.startswith(f"sync code: {proj}: ")]
    assert len(said) == 1 and said[0].startswith(f"sync code: {proj}: 1 file (") and \
        said[0].endswith("left out as possible secrets: .env, .ssh/, id_ed25519, key.pem"), lines
    for n, outcome in zip(sandbox3.nodes, result.nodes):
        assert sorted(os.listdir(Path(n.workdir, "code", "run", proj.name))) == ["show.py"]
        assert "FILES ['show.py']" in Path(outcome.log).read_text()


def test_run_diloco_user_script_cuts_bytes_by_about_h_with_equal_hashes(sandbox3, cli, tmp_path):
    """A user's script on the session API (examples/image_classifier.py), synced to 3 nodes: the
    same steps under ddp and under `--strategy diloco --sync-every 8` (fp32 wire): diloco's
    bytes on the wire are about 8x fewer, and every rank ends with the same weights in both."""
    h = 8
    reports = {}
    for name, flags in (("ddp", ()), ("diloco", ("--strategy", "diloco", "--sync-every", str(h)))):
        run_dir = tmp_path / name
        r = cli("run", "--cluster", sandbox3.cluster_file, "--run-dir", str(run_dir), "--sync", str(REPO / "examples"),
                "--threads-per-rank", "1", *flags, "--", "python", "image_classifier.py", "--epochs", "2", "--samples", "1536",
                timeout=300)
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
        report = json.loads((run_dir / "report.json").read_text())  # fetched from rank 0's node
        assert report["strategy"] == name and report["world_size"] == 3 and report["steps"] == 2 * 1536 // (3 * 32)
        assert [p["model_sha256"] for p in report["per_rank"]] == [report["model_sha256"]] * 3, name
        reports[name] = report
    ratio = sum(reports["ddp"]["bytes_sent"]) / sum(reports["diloco"]["bytes_sent"])
    print(f"bytes sent: ddp {sum(reports['ddp']['bytes_sent'])}, diloco {sum(reports['diloco']['bytes_sent'])}, "
          f"ratio {ratio:.2f}; wall ddp {reports['ddp']['wall_seconds']:.1f} s, diloco {reports['diloco']['wall_seconds']:.1f} s")
    assert 0.6 * h < ratio < 1.4 * h, f"ddp/diloco bytes {ratio:.2f}, expected about {h}"
    assert training_leftovers(sandbox3) == {n.name: [] for n in sandbox3.nodes}


def test_run_goes_on_without_a_dead_node_from_the_session_checkpoint(sandbox3, tmp_path):
    """`vpscluster run` with recovery on by default (3 nodes: relaunch while 2 answer): a user's
    script on the session API (examples/image_classifier.py, a checkpoint every 10 steps)
    loses node-3 mid-run — off the network, then every process on it killed (a VPS powered off).
    The survivors' collectives time out (`--collective-timeout 5`), the launcher relaunches the
    script on node-1 and node-2 with the session's resume on, the session continues from its
    newest checkpoint (re-cut for two ranks), and the run finishes there: the report says two
    ranks, the checkpoint step resumed from, the recovery, and equal final weights."""
    from vpscluster.cluster.sandbox import faults
    from sandbox_fixtures import ssh_run

    run_dir = tmp_path / "run"
    # The module's cluster file with a 5 s SSH connect time-out (the file's own setting; 10 s by
    # default): whether node-3, off the network, answers is looked at after the failure.
    cluster_file = cluster_file_with(sandbox3, tmp_path / "cluster.yaml", connect_timeout_s=5)
    assert "connect_timeout_s: 5\n" in cluster_file.read_text()
    proc = subprocess.Popen(
        [sys.executable, "-m", "vpscluster", "run", "--cluster", str(cluster_file), "--run-dir", str(run_dir),
         "--sync", str(REPO / "examples"), "--checkpoint-every", "10", "--collective-timeout", "5", "--threads-per-rank", "1",
         "--json",
         "--", "python", "image_classifier.py", "--epochs", "2", "--samples", "9600"],
        stdout=(tmp_path / "out").open("w"), stderr=(tmp_path / "err").open("w"), env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    t0 = time.monotonic()
    try:
        deadline = time.monotonic() + 120
        while not any('"event":"checkpoint"' in p.read_text(errors="replace")
                      for p in (run_dir / "logs").glob("node-*.log")):
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "err").read_text()[-3000:]
            time.sleep(0.2)
        faults.inject(sandbox3.name, "node-3", "link-down", seconds=300)
        cut = time.monotonic()
        faults.inject(sandbox3.name, "node-3", "kill")
        proc.wait(timeout=180)
        done = time.monotonic()
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=30)
        faults.clear(sandbox3.name, "node-3")
    out, err = (tmp_path / "out").read_text(), (tmp_path / "err").read_text()
    print(f"first checkpoint {cut - t0:.1f} s after the start; finished {done - cut:.1f} s after node-3 went down")
    assert proc.returncode == 0, err[-4000:]
    assert "recovery: on" in err and "relaunching on 2 nodes from the last checkpoint without node-3" in err, err[-3000:]
    doc = json.loads(out)  # the last launch
    assert doc["ok"] and [n["name"] for n in doc["nodes"]] == ["node-1", "node-2"]
    report = json.loads((run_dir / "report.json").read_text())
    assert report["world_size"] == 2 and report["stopped_by"] == "end_of_loop"
    assert report["resumed_from_step"] and report["resumed_from_step"] % 10 == 0, report["resumed_from_step"]
    (lost,) = report["recoveries"]
    assert lost["kind"] == "restart" and lost["out"] == ["node-3"] and lost["nodes"] == ["node-1", "node-2"], lost
    assert lost["resumed_from_step"] == report["resumed_from_step"] and lost["after_step"] >= lost["resumed_from_step"]
    print(f"the relaunch resumed from step {lost['resumed_from_step']} {lost['resumed_after_s']} s after the failure was seen")
    assert [p["model_sha256"] for p in report["per_rank"]] == [report["model_sha256"]] * 2
    # One history across both launches: the first launch's steps up to the checkpoint, then the relaunch's.
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == sorted(set(steps)) and steps[0] <= report["resumed_from_step"] < steps[-1] == report["steps"]
    # Both epochs were trained once: 2 epochs of 64-sample steps at most, more than one epoch of them.
    assert 9600 // 96 + 9600 // 64 <= report["steps"] <= 2 * (9600 // 64), report["steps"]
    deadline = time.monotonic() + 60  # node-3 answers again before the module's next test
    while ssh_run(sandbox3, "node-3", "true", timeout_s=10).returncode != 0:
        assert time.monotonic() < deadline, "node-3 did not answer after the fault was cleared"
        time.sleep(1)
    assert training_leftovers(sandbox3) == {n.name: [] for n in sandbox3.nodes}
