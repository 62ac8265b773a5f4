"""Uneven nodes from the command line: `plan --flops a,b,c` shows the shares and what balancing
buys; `sandbox set` and `train --micro-batches` refuse bad input in one line."""

from __future__ import annotations

import json

import pytest


@pytest.fixture
def plan(cli, tmp_path):
    def run(*args):
        return cli("plan", *args, timeout=120, env={"HOME": str(tmp_path)})
    return run


def test_plan_balance_section_for_uneven_flops(plan):
    r = plan("--model", "small", "--flops", "80,80,27", "--bandwidth", "1gbit", "--strategy", "ddp", "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["world_size"] == 3
    bal = doc["balance"]
    assert sum(bal["shares"]) == bal["global_batch"] == 3 * doc["model"]["batch_size"]
    assert bal["shares"][0] == bal["shares"][1] > bal["shares"][2]
    # balanced: the 27 GFLOP/s node no longer sets the pace (even split ~ 3x the fast nodes' step)
    assert bal["speedup"] > 1.5
    assert bal["balanced_step_seconds"] < bal["even_step_seconds"] == pytest.approx(doc["step_seconds"])
    assert "--micro-batches 12" in bal["train_flags"]
    # 5:5:2 of 12 for speeds 80:80:27: the 27 GFLOP/s node needs 2/27 against 12/187 for an exact split
    assert bal["split_gap"] == pytest.approx((2 / 27) / (12 / 187) - 1, rel=0.02)
    human = plan("--model", "small", "--flops", "80,80,27", "--bandwidth", "1gbit", "--strategy", "ddp")
    assert human.returncode == 0 and "Uneven nodes" in human.stdout and "5:5:2" in human.stdout
    assert "15% longer than an exact split" in human.stdout, human.stdout


def test_plan_balance_for_diloco_keeps_the_inner_steps_and_refines_the_round(plan):
    """DiLoCo: a micro-batch is an inner step of --batch-size sequences. 0.6:0.3:0.15 of a node
    split in 3 micro-batches is no split at all; the plan doubles them (and halves H) until the
    split is within 10% of an exact one, keeping the inner steps per round."""
    r = plan("--model", "tiny", "--flops", "60,30,15", "--bandwidth", "1gbit", "--strategy", "diloco",
             "--sync-every", "20", "--json")
    assert r.returncode == 0, r.stderr
    bal = json.loads(r.stdout)["balance"]
    assert bal["unit"].startswith("micro-batches")
    k = bal["global_batch"] // 3
    assert k > 1 and 20 % k == 0 and f"--micro-batches {3 * k} --sync-every {20 // k}" in bal["train_flags"]
    assert "--batch-size 1" not in bal["train_flags"]
    assert bal["split_gap"] <= 0.10 and bal["speedup"] > 1.3
    assert bal["round_seconds_balanced"] < bal["round_seconds_even"]


def test_plan_even_flops_buys_nothing_and_wrong_count_is_one_line(plan):
    r = plan("--model", "small", "--flops", "80,80", "--bandwidth", "1gbit", "--strategy", "ddp", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["balance"]["speedup"] == pytest.approx(1.0)
    bad = plan("--model", "small", "--flops", "80,80,27", "--nodes", "2")
    assert bad.returncode != 0 and len(bad.stderr.strip().splitlines()) == 1 and "one per node" in bad.stderr


@pytest.mark.parametrize("args,needle", [
    (("sandbox", "set", "--name", "ue-none", "--node", "node1"), "nothing to change"),
    (("sandbox", "set", "--name", "ue-none", "--node", "node1", "--cpu", "0.1"), "does not exist"),
    (("train", "--nodes", "2", "--balance"), "--micro-batches"),
    (("train", "--nodes", "3", "--micro-batches", "2"), "at least 3"),
    (("train", "--nodes", "2", "--micro-batches", "4", "--speeds", "3,x"), "comma-separated"),
])
def test_bad_uneven_input_is_one_line(cli, args, needle):
    r = cli(*args, timeout=120)
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert needle in lines[-1] and "Traceback" not in r.stderr, r.stderr
    if args[0] == "sandbox" or "--speeds" not in args:  # argparse's own errors come after its usage
        assert len(lines) == 1, r.stderr
