"""`vpscluster train` through the one launch pipeline: dry runs (snapshots) and refusals that
create nothing. The local cluster's runs themselves are covered by test_train_cli.py."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from snapshot_check import check_snapshot


def _normalised(doc: dict, cwd: Path) -> dict:
    """Machine-specific paths (this interpreter, the test's folder) replaced by names."""
    text = json.dumps(doc).replace(sys.executable, "PYTHON").replace(str(cwd), "CWD")
    text = re.sub(r"runs/fixed-[0-9a-f]{8}\b", "runs/fixed-UID", text)  # the run's random run_uid
    return json.loads(text)


def test_local_dry_run_snapshot_runs_and_creates_nothing(tmp_path, cli):
    r = cli("train", "--dry-run", "--json", "--nodes", "3", "--threads-per-rank", "1", "--run-dir", "runs/fixed",
            "--max-steps", "7", timeout=120, cwd=str(tmp_path))
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    check_snapshot("train_dry_run_local.json", _normalised(doc, tmp_path.resolve()))
    assert doc["recovery"]["max_restarts"] == 0  # the local cluster has no node to lose
    (node,) = doc["nodes"]
    argv = node["argv"]
    # One local node (loopback) running every rank, a c10d rendezvous on loopback, the trainer.
    assert node["address"] == "127.0.0.1" and node["head"]
    assert argv[argv.index("--nproc-per-node") + 1] == "3"
    assert argv[argv.index("--rdzv-backend") + 1] == "c10d"
    assert argv[argv.index("--rdzv-endpoint") + 1].startswith("127.0.0.1:")
    assert argv[argv.index("-m", 3) + 1] == "vpscluster.train.worker" and "runs/fixed" in argv
    assert node["env"]["OMP_NUM_THREADS"] == "1"
    assert list(tmp_path.iterdir()) == []  # no run folder, nothing else


def test_cluster_dry_run_snapshot(tmp_path, cli):
    key = tmp_path / "id_test"
    key.write_text("not a real key\n")
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(
        f"defaults: {{identity_file: {key}, python: /opt/venv/bin/python, workdir: /srv/vpscluster}}\n"
        "nodes:\n  - {name: node-a, host: 203.0.113.10}\n  - {name: node-b, host: 203.0.113.11}\n"
    )
    r = cli("train", "--cluster", str(cluster), "--dry-run", "--json", "--run-dir", "runs/fixed", "--nproc-per-node", "2",
            timeout=120, cwd=str(tmp_path))
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    check_snapshot("train_dry_run_cluster.json", _normalised(doc, tmp_path.resolve()))
    assert [n["name"] for n in doc["nodes"]] == ["node-a", "node-b"]
    assert all(n["env"]["PYTHONPATH"] == "/srv/vpscluster/code/src" for n in doc["nodes"])
    assert all(re.search(r"--run-dir runs/fixed-[0-9a-f]{8} ", n["command"]) for n in doc["nodes"])
    assert not (tmp_path / "runs").exists()
    # No recovery flag: on by default, the survivors go on while half the nodes (1 of 2) remain.
    assert doc["recovery"] == {"max_restarts": 4, "min_nodes": 1, "nodes": 2, "by_default": True}
    assert any(n.startswith("recovery: on (") and "at least 1 of 2 nodes remain" in n for n in doc["notes"]), doc["notes"]
    off = cli("train", "--cluster", str(cluster), "--dry-run", "--run-dir", "runs/fixed", "--max-restarts", "0",
              timeout=120, cwd=str(tmp_path))
    assert off.returncode == 0 and "recovery: off (--max-restarts 0: the first failure ends the run)" in off.stdout, off


def test_refused_commands_create_no_run_folder(tmp_path, cli):
    bad_cluster = tmp_path / "bad.yaml"
    bad_cluster.write_text("nodes: 3\n")
    unreachable_key = tmp_path / "k"
    unreachable_key.write_text("x")
    refused = [
        (["--cluster", str(bad_cluster)], "nodes: expected a list"),
        (["--cluster", str(tmp_path / "missing.yaml")], "no such cluster file"),
        (["--data", str(tmp_path / "missing.txt")], "no such file or folder"),
        (["--max-steps", "0"], "max_steps must be at least 1"),
    ]
    for args, expected in refused:
        r = cli("train", *args, timeout=120, cwd=str(tmp_path))
        assert r.returncode == 2, (args, r.stderr)
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and expected in lines[0], (args, r.stderr)
        assert not (tmp_path / "runs").exists(), args  # the default run folder was never made


def test_library_prepare_creates_nothing(tmp_path, monkeypatch):
    """A Python user's `prepare_training` checks and resolves; only a launch creates the run dir."""
    from vpscluster.launch.train import prepare_training
    from vpscluster.train.config import TrainConfig

    monkeypatch.chdir(tmp_path)
    run = prepare_training(TrainConfig(max_steps=40))
    assert run.local and run.cfg.lr_decay_steps == 40  # the LR horizon is fixed for later resumes
    assert run.run_dir.parent == Path("runs") and run.cfg.run_dir == str(run.run_dir)
    assert list(tmp_path.iterdir()) == []


def test_an_interrupt_is_a_user_error_with_exit_130():
    """The pipeline reports Ctrl-C as `Interrupted`, never as KeyboardInterrupt carrying control."""
    import asyncio

    import pytest

    from vpscluster.errors import Interrupted, UserError, unless_interrupted

    async def go():
        stop = asyncio.Event()
        stop.set()
        await unless_interrupted(asyncio.sleep(30), stop)

    with pytest.raises(Interrupted) as e:
        asyncio.run(go())
    assert isinstance(e.value, UserError) and e.value.exit_code == 130 and "interrupted" in str(e.value)


def test_cli_prints_one_interrupted_line(monkeypatch, capsys):
    import argparse

    from vpscluster import cli
    from vpscluster.errors import Interrupted

    class Stopped:
        @staticmethod
        def run(args):
            raise Interrupted()

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args",
                        lambda self, argv=None: argparse.Namespace(_module=Stopped, command="train"))
    assert cli.main([]) == 130
    assert capsys.readouterr().err == "vpscluster train: interrupted\n"


def test_a_new_run_named_as_an_older_one_gets_a_folder_of_its_own_on_the_nodes(tmp_path, monkeypatch):
    """The run's folder on the nodes used to be runs/<the local folder's name>: a new run in
    another local folder of that name found the older run's checkpoints there on a relaunch.
    It is now keyed by the run's own run_uid too, kept by --resume; runs made before keep theirs."""
    from vpscluster.launch.train import prepare_training, training_job
    from vpscluster.train import rundir
    from vpscluster.train.config import StrategyConfig, TrainConfig

    monkeypatch.chdir(tmp_path)
    (tmp_path / "k").write_text("x")
    cluster = tmp_path / "c.yaml"
    cluster.write_text(f"defaults: {{identity_file: {tmp_path / 'k'}, workdir: /w}}\n"
                       "nodes:\n  - {name: a, host: 203.0.113.10}\n  - {name: b, host: 203.0.113.11}\n")

    def on_nodes(run) -> str:
        return training_job(run.cfg, run.run_dir, run.cluster, resume=run.resume).node_run_dir("/w")

    cfg = TrainConfig(cluster=str(cluster), max_steps=5, strategy=StrategyConfig(name="ddp"))
    first = prepare_training(TrainConfig(**{**vars(cfg), "run_dir": str(tmp_path / "one" / "run")}))
    second = prepare_training(TrainConfig(**{**vars(cfg), "run_dir": str(tmp_path / "two" / "run")}))
    assert on_nodes(first) != on_nodes(second), on_nodes(first)
    assert all(re.fullmatch(r"/w/runs/run-[0-9a-f]{8}", on_nodes(r)) for r in (first, second))
    # --resume reads the stored configuration: the same folder on the nodes as before.
    rundir.create(first.run_dir)
    rundir.write_config(first.cfg, first.run_dir)
    resumed = prepare_training(rundir.read_config(first.run_dir), resume_dir=first.run_dir)
    assert on_nodes(resumed) == on_nodes(first)
    # A run made before run_uid existed keeps runs/<its folder's name>.
    old = tmp_path / "old" / "run"
    rundir.create(old)
    rundir.write_config(TrainConfig(**{**vars(first.cfg), "run_uid": "", "run_dir": str(old)}), old)
    assert on_nodes(prepare_training(rundir.read_config(old), resume_dir=old)) == "/w/runs/run"
