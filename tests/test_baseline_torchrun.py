"""The plain torchrun + DDP baseline (vpscluster/bench/baselines/torchrun_ddp.py): runs under torchrun with
2 local processes, trains, writes its result, imports nothing but torch, numpy and the standard
library, and builds exactly the model vpscluster trains for the same shape."""

from __future__ import annotations

import ast
import gzip
import importlib.util
import json
import subprocess
import sys
from importlib import resources

import pytest

from conftest import free_port
from vpscluster.bench.wan import BASELINE

SCRIPT = BASELINE  # shipped inside the package (vpscluster/bench/baselines/)


def test_baseline_imports_nothing_from_vpscluster():
    tree = ast.parse(SCRIPT.read_text())
    roots = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            roots.add(node.module.split(".")[0])
    assert roots - set(sys.stdlib_module_names) == {"torch", "numpy"}


def test_baseline_model_has_the_shape_vpscluster_trains():
    from vpscluster.train.model import build_model
    from vpscluster.train.presets import get_preset

    spec = importlib.util.spec_from_file_location("torchrun_ddp", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    shape = get_preset("small")
    theirs = mod.GPT(256, shape.d_model, shape.n_layer, shape.n_head, shape.seq_len)
    ours = build_model(shape, seed=0)
    assert [p.shape for p in theirs.parameters()] == [p.shape for p in ours.parameters()]
    assert sum(p.numel() for p in theirs.parameters()) == shape.num_params()


@pytest.mark.slow
def test_baseline_trains_on_two_processes(tmp_path):
    corpus = tmp_path / "corpus.txt"
    with resources.files("vpscluster.data").joinpath("kjv.txt.gz").open("rb") as f:
        corpus.write_bytes(gzip.decompress(f.read())[:400_000])
    out = tmp_path / "result.json"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
        "--master-port", str(free_port()), str(SCRIPT), "--data", str(corpus), "--out", str(out),
        "--d-model", "64", "--n-layer", "2", "--n-head", "2", "--seq-len", "64", "--batch-size", "8",
        "--max-steps", "12", "--eval-every", "6", "--eval-batches", "4", "--warmup-steps", "0",
        "--threads", "1", "--timeout-s", "60",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["world_size"] == 2 and r["steps"] == 12
    assert r["tokens"] == 12 * 8 * 64 * 2
    assert [e["step"] for e in r["evals"]] == [0, 6, 12]
    assert [e["tokens"] for e in r["evals"]] == [0, 6 * 512 * 2, 12 * 512 * 2]
    assert r["evals"][-1]["val_loss"] < r["evals"][0]["val_loss"] - 0.5  # it learned
    assert len(r["losses"]) == 12 and all(l == l for l in r["losses"])
    assert 0 < r["compute_utilization"] <= 1.5
    assert r["wall_seconds"] >= r["train_seconds"] > 0
