"""`train --balance` on the sandbox starts from the probe's speeds: two nodes at 0.75 and 0.25
core, probed for real, train two steps (no rebalancing look yet) and the starting shares are
those the probe's FLOP/s give - about 3:1 of 8 micro-batches, not 4:4. With no flag at all the
run balances by default (3:1 is over 15%): one line, the slow node's rank gets fewer micro-batches
of the same global batch (decided from pre-flight's probe: the sandbox has none yet). A
`--speeds` list of the wrong length is refused after pre-flight, before anything is created.
`vpscluster run` of a user's session script on the same nodes balances by default alike (diloco:
the fast node's rank takes more inner steps a step) and every rank ends with the same weights.
The sandbox (one for the module) is named "[test prefix]us-...".
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from sandbox_fixtures import SandboxFactory
from vpscluster.cluster.inventory import load_cluster
from vpscluster.plan.balance import choose_split
from vpscluster.probe.store import load_probe
from vpscluster.train.shares import split

pytestmark = [pytest.mark.sandbox, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def uneven2():
    """Two nodes, three quarters of a core against a quarter."""
    factory = SandboxFactory(kind="us-")
    try:
        yield factory(nodes=2, bandwidth="1gbit", cpu="0.75,0.25")
    finally:
        factory.close()


@pytest.mark.timeout(600)
def test_starting_shares_follow_the_probe(uneven2, cli, tmp_path):
    info = uneven2
    train = ("train", "--cluster", info.cluster_file, "--max-steps", "2", "--batch-size", "1",
             "--micro-batches", "8", "--eval-every", "1000")

    # No flag at all, as a new user: no probe yet, so pre-flight takes a quick one; its ~3:1 is
    # over 15%, so the run balances by default and says so in one line: tiny's global batch of
    # 2 x 16 sequences in finer micro-batches, the slow node's rank fewer.
    slow, fast = info.nodes[1].name, info.nodes[0].name
    r = cli("train", "--cluster", info.cluster_file, "--preset", "tiny", "--strategy", "ddp", "--max-steps", "2",
            "--eval-every", "1000", "--run-dir", str(tmp_path / "default"), "--json", timeout=400)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [line for line in r.stderr.splitlines() if "balancing: " in line]
    assert len(lines) == 1 and f"balancing: {slow} is " in lines[0] and f"x slower than {fast}" in lines[0], r.stderr
    assert "micro-batches " in lines[0] and "(--no-balance to turn off)" in lines[0]
    report = json.loads(r.stdout)
    assert report["balance"] is True and report["rebalances"] == 0
    assert max(report["speeds"]) > 1.5 * min(report["speeds"])  # pre-flight's probe: the quotas are felt
    chosen = choose_split(report["speeds"], 16, micro_batches_are_steps=False)
    assert report["micro_batches"] == chosen.micro_batches > 2 and report["shares"] == list(chosen.shares)
    slow_rank = report["speeds"].index(min(report["speeds"]))
    assert report["shares"][slow_rank] < report["shares"][1 - slow_rank], report["shares"]
    config = (tmp_path / "default" / "config.yaml").read_text()
    # The global batch of 32 sequences is kept, in micro-batches of fewer sequences.
    assert f"batch_size: {chosen.batch_size}\n" in config and chosen.batch_size * chosen.micro_batches == 32, config
    assert f"micro-batches {'/'.join(str(v) for v in sorted(chosen.shares, reverse=True))} of " in lines[0], lines

    # One rank per node (no GPUs, known only after pre-flight): 3 speeds for 2 ranks is refused.
    bad = cli(*train, "--speeds", "1,1,1", "--run-dir", str(tmp_path / "bad"), timeout=300)
    assert bad.returncode != 0
    assert "--speeds gives 3 figures but this run has 2 ranks" in bad.stderr.strip().splitlines()[-1], bad.stderr
    assert not (tmp_path / "bad").exists()

    # The quick probe the first run's pre-flight took is saved beside the cluster file, as
    # `vpscluster probe --quick` saves its own: the run below starts from it.
    probe = load_probe(load_cluster(info.cluster_file))
    assert probe is not None and probe["quick"] and probe["cluster"]["nodes"] == [fast, slow], probe
    flops = {n["name"]: n["flops"] for n in probe["nodes"]}
    assert flops[info.nodes[0].name] > 1.5 * flops[info.nodes[1].name]  # the quotas are felt

    r = cli(*train, "--balance", "--run-dir", str(tmp_path / "run"), "--json", timeout=400)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "shares start from the probe's speeds" in r.stderr
    report = json.loads(r.stdout)
    # No rebalancing look within 2 steps: the speeds are the probe's, by the node of each rank.
    assert report["rebalances"] == 0
    assert sorted(report["speeds"]) == pytest.approx(sorted(flops.values()), rel=1e-3)
    assert report["shares"] == split(report["speeds"], 8, 1, 8.0)
    assert sorted(report["shares"]) in ([1, 7], [2, 6]), report["shares"]
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["shares"] for m in metrics if "shares" in m] == [report["shares"]] * 2



@pytest.mark.timeout(300)
def test_run_balances_a_session_script_by_default(uneven2, cli, tmp_path):
    """A user's script on the session API (examples/image_classifier.py) under `run --strategy
    diloco` and no balancing flag: the probe (saved, or pre-flight's) shows 3:1 quotas, so the
    session gets train's split - more inner steps of the script's batch for the fast node's rank,
    the same rounds of H inner steps on average - said in one line; the shares are in the report
    and in metrics.jsonl; every rank ends with the same weights. (`--no-balance` and a ddp
    session's batches sized by share: tests/test_balance_default.py, tests/test_session_ddp_shares.py.)"""
    info, h, batch = uneven2, 4, 16
    fast, slow = info.nodes[0].name, info.nodes[1].name
    t0 = time.monotonic()
    run_dir = tmp_path / "run"
    r = cli("run", "--cluster", info.cluster_file, "--run-dir", str(run_dir), "--sync", str(REPO / "examples"),
            "--strategy", "diloco", "--sync-every", str(h), "--", "python", "image_classifier.py", "--epochs", "1",
            "--samples", "512", "--batch-size", str(batch), timeout=240)
    wall = time.monotonic() - t0
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    out = r.stdout + r.stderr
    lines = [line for line in out.splitlines() if "balancing: " in line]
    assert len(lines) == 1 and f"balancing: {slow} is " in lines[0] and f"x slower than {fast}" in lines[0], out
    report = json.loads((run_dir / "report.json").read_text())  # fetched from rank 0's node
    shares, total = report["shares"], report["micro_batches"]
    assert report["strategy"] == "diloco" and report["world_size"] == 2 and sum(shares) == total > 2
    assert shares[0] > shares[1] >= 1, shares  # rank 0 runs on the fast node (the head)
    assert report["balance"] is True and report["speeds"][0] > report["speeds"][1]
    assert f"batches {'/'.join(map(str, shares))} of {total} a step" in lines[0] or report["rebalances"], lines
    assert report["steps"] == 512 // (total * batch)  # an epoch of the script's batches, cut into steps of total
    assert [p["model_sha256"] for p in report["per_rank"]] == [report["model_sha256"]] * 2
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["samples"] for m in metrics][-1] == shares[0] * batch  # rank 0's inner steps of the last step
    print(f"{lines[0]}\nrun balanced by default: shares {shares} of {total}, speeds {report['speeds']} "
          f"({report['rebalances']} rebalances), {report['steps']} steps, wall {report['wall_seconds']:.1f} s "
          f"(command {wall:.1f} s)")

