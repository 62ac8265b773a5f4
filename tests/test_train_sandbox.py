"""`vpscluster train --cluster` end to end on a real 2-node sandbox, one per option that changes
what runs on the nodes: DiLoCo, bf16 gradient compression, `--strategy auto`, `--resume`,
`--time-budget`, `--detach` then `stop` (a checkpoint on the nodes, nothing left running, a
resume from it), and pre-flight refusing a node whose PyTorch differs.

One sandbox serves the whole module, shared with other launch-only modules (start-up and the
first launch's quick probe are the expensive part); the smallest preset, few steps, small
batches and one thread per rank keep each run short. After every run the ranks'
final weights are compared by hash (`per_rank[].model_sha256`), not only their losses.
"""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

import pytest
import yaml

from conftest import pid_alive, processes_mentioning
from sandbox_fixtures import node_run_dir

pytestmark = [pytest.mark.sandbox, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def sandbox2(shared2):
    """The session's shared 2-node sandbox (sandbox_fixtures.shared2): these tests leave it as they
    found it (test_preflight_refuses_a_node_whose_torch_differs changes a copy of its cluster file)."""
    return shared2


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """A small corpus and the settings every run shares (an LR horizon fixed at 4 steps, so a
    2-step run resumed to 4 follows the same schedule as a straight 4-step run)."""
    root = tmp_path_factory.mktemp("train-sandbox")
    corpus = root / "corpus.txt"
    with gzip.open(REPO / "src" / "vpscluster" / "data" / "kjv.txt.gz", "rt") as f:
        corpus.write_text(f.read(200_000))
    config = root / "common.yaml"
    config.write_text(yaml.safe_dump({"preset": "tiny", "data": str(corpus), "batch_size": 4, "eval_batches": 2,
                                      "eval_every": 4, "checkpoint_every": 2, "lr_decay_steps": 4, "threads_per_rank": 1}))
    return root, config


def train(cli, sandbox, config, *args, ok=True):
    r = cli("train", "--cluster", sandbox.cluster_file, "--config", str(config), *args, "--json", timeout=400)
    if ok:
        assert r.returncode == 0, r.stderr[-3000:]
        return json.loads(r.stdout), r
    return None, r


def assert_replicas_identical(report):
    hashes = [r["model_sha256"] for r in report["per_rank"]]
    assert len(hashes) == report["world_size"] == 2
    assert hashes == [report["model_sha256"]] * 2, hashes


def test_diloco_then_resume_equals_a_straight_run(sandbox2, workspace, cli):
    root, config = workspace
    diloco = ["--strategy", "diloco", "--sync-every", "2"]
    straight, _ = train(cli, sandbox2, config, *diloco, "--max-steps", "4", "--run-dir", str(root / "straight"))
    assert straight["strategy"] == "diloco" and straight["steps"] == 4
    assert straight["strategy_details"]["sync_every"] == 2
    assert all(b > 0 for b in straight["bytes_sent"])
    assert_replicas_identical(straight)  # the last outer sync leaves every node the same model

    # The planner picks the wire from the measured step time, which a loaded machine changes
    # between two runs: the stopped run takes the straight run's choice, so the two compare.
    wire = straight["strategy_details"]["wire_dtype"]
    first, _ = train(cli, sandbox2, config, *diloco, "--wire-dtype", wire, "--max-steps", "2",
                     "--run-dir", str(root / "resumed"))
    assert first["steps"] == 2 and first["model_sha256"] != straight["model_sha256"]
    r = cli("train", "--resume", str(root / "resumed"), "--max-steps", "4", "--json", timeout=400)
    assert r.returncode == 0, r.stderr[-3000:]
    resumed = json.loads(r.stdout)
    assert resumed["resumed_from_step"] == 2 and resumed["steps"] == 4 and resumed["strategy"] == "diloco"
    assert_replicas_identical(resumed)
    # Every node continued from its checkpoint: the same weights as never stopping at all.
    assert resumed["model_sha256"] == straight["model_sha256"]
    assert resumed["optimizer_sha256"] == straight["optimizer_sha256"]


def test_ddp_with_bf16_compression_halves_the_bytes(sandbox2, workspace, cli):
    root, config = workspace
    report, _ = train(cli, sandbox2, config, "--strategy", "ddp", "--compress", "bf16", "--max-steps", "3",
                      "--run-dir", str(root / "bf16"))
    assert report["strategy"] == "ddp" and report["strategy_details"]["compress"] == "bf16" and report["steps"] == 3
    assert_replicas_identical(report)
    # A 2-rank all-reduce sends each gradient once: 2 bytes a parameter in bf16 (4 in fp32).
    per_step = report["bytes_sent"][0] / report["steps"]
    assert 1.8 * report["num_params"] <= per_step <= 2.3 * report["num_params"], (per_step, report["num_params"])


def test_strategy_auto_resolves_and_says_why(sandbox2, workspace, cli):
    root, config = workspace
    report, r = train(cli, sandbox2, config, "--strategy", "auto", "--max-steps", "8", "--checkpoint-every", "4",
                      "--run-dir", str(root / "auto"))
    assert report["strategy"] in ("ddp", "diloco") and report["steps"] == 8
    assert f"strategy auto -> {report['strategy']}" in r.stderr, r.stderr[-2000:]
    assert_replicas_identical(report)


def test_time_budget_stops_every_rank_with_a_checkpoint(sandbox2, workspace, cli):
    root, config = workspace
    report, _ = train(cli, sandbox2, config, "--time-budget", "2", "--max-steps", "100000",
                      "--checkpoint-every", "100000", "--run-dir", str(root / "budget"))
    assert report["stopped_by"] == "time_budget" and 1 <= report["steps"] < 100000
    assert report["wall_seconds"] < 60
    assert_replicas_identical(report)
    # The checkpoint at the stop was written on the nodes (each in its own work directory).
    step_dir = f"step-{report['steps']:08d}"
    written = [n.name for n in sandbox2.nodes
               if (node_run_dir(n, root / "budget") / "checkpoints" / step_dir / "manifest.json").exists()]
    assert written, [str(node_run_dir(n, root / "budget")) for n in sandbox2.nodes]


@pytest.mark.timeout(600)
def test_detached_run_stopped_checkpoints_on_the_nodes_leaves_nothing_and_resumes(sandbox2, workspace, cli):
    import time

    root, config = workspace
    run = root / "detached"
    r = cli("train", "--cluster", sandbox2.cluster_file, "--config", str(config), "--detach", "--json",
            "--max-steps", "100000", "--checkpoint-every", "100000", "--eval-every", "100000",
            "--run-dir", str(run), timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    pid = json.loads(r.stdout)["pid"]
    log = run / "logs" / "detached.log"

    def steps_done() -> int:  # rank 0 writes a metrics line per step on its node
        if not (run / "config.yaml").exists():  # written once the nodes passed pre-flight
            return 0
        files = [node_run_dir(n, run) / "metrics.jsonl" for n in sandbox2.nodes]
        return max((f.read_text().count('"loss"') for f in files if f.exists()), default=0)

    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and steps_done() < 3:
        assert pid_alive(pid), log.read_text()[-3000:] if log.exists() else "no launcher log"
        time.sleep(0.5)
    assert steps_done() >= 3, log.read_text()[-3000:]

    s = cli("stop", "--json", str(run), timeout=200)
    assert s.returncode == 0, s.stderr[-3000:]
    stopped = json.loads(s.stdout)
    assert stopped["forced"] is False and stopped["exit_status"] == 130, stopped
    report = json.loads((run / "report.json").read_text())  # fetched from rank 0's node
    k = report["steps"]
    assert report["stopped_by"] == "stop_requested" and k >= 3
    assert_replicas_identical(report)  # both nodes stopped after the same step
    step_dir = f"step-{k:08d}"
    written = [n.name for n in sandbox2.nodes
               if (node_run_dir(n, run) / "checkpoints" / step_dir / "manifest.json").exists()]
    assert written, "no node holds the stop's checkpoint"
    time.sleep(1.0)
    assert not pid_alive(pid)
    left = processes_mentioning("runs/detached") + processes_mentioning(str(run))
    assert left == [], left  # no launcher, agent, worker or guard left on any node

    r = cli("train", "--resume", str(run), "--max-steps", str(k + 2), "--json", timeout=400)
    assert r.returncode == 0, r.stderr[-3000:]
    resumed = json.loads(r.stdout)
    assert resumed["resumed_from_step"] == k and resumed["steps"] == k + 2
    assert_replicas_identical(resumed)


def test_preflight_refuses_a_node_whose_torch_differs(sandbox2, workspace, cli, tmp_path):
    """node-2's `python` is a wrapper whose PyTorch says 2.0.0: pre-flight stops before any start."""
    root, config = workspace
    doc = yaml.safe_load(Path(sandbox2.cluster_file).read_text())
    real = doc["nodes"][1].get("python") or doc.get("defaults", {}).get("python") or sys.executable
    fake = tmp_path / "fake-torch"
    fake.mkdir()
    (fake / "sitecustomize.py").write_text("import torch\ntorch.__version__ = '2.0.0'\n")
    wrapper = tmp_path / "python"
    wrapper.write_text(f'#!/bin/sh\nPYTHONPATH="{fake}${{PYTHONPATH:+:$PYTHONPATH}}" exec "{real}" "$@"\n')
    wrapper.chmod(0o755)
    doc["nodes"][1]["python"] = str(wrapper)
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(yaml.safe_dump(doc, sort_keys=False))
    run_dir = tmp_path / "refused"
    r = cli("train", "--cluster", str(cluster), "--config", str(config), "--max-steps", "2", "--run-dir", str(run_dir),
            timeout=400)
    assert r.returncode != 0
    err = r.stderr.strip().splitlines()
    assert len(err) == 1 and "pre-flight: node-2: PyTorch versions differ" in err[0], r.stderr[-2000:]
    assert "2.0.0 on node-2" in err[0] and "--force" in err[0], err[0]
    assert not any(list(Path(n.workdir, "runs").glob("refused*")) for n in sandbox2.nodes)  # nothing started
