"""The fault benchmark's bookkeeping: recoveries lined up with the faults that caused them, steps
lost, the comparison with the fault-free run, and the settings it refuses. (The benchmark itself
runs faults in a sandbox: `vpscluster bench faults`, BENCHMARKS.md.)"""

from __future__ import annotations

import pytest

from vpscluster.bench import faults as bf
from vpscluster.errors import UserError


def _fault(name, at, seconds=0, step=10):
    return {"fault": name, "node": "node-3", "seconds": seconds, "step": step, "at": at, "ends": at + seconds,
            "hang": False, "longest_pause_s": 1.0}


def test_recoveries_are_attributed_to_the_fault_before_them():
    injected = [_fault("link-5s", 100.0, 5), _fault("link-long", 200.0, 40, step=20), _fault("worker-kill", 400.0, step=30)]
    recoveries = [
        {"kind": "restart", "after_step": 23, "resumed_from_step": 20, "out": ["node-3"], "detected_at": 215.5,
         "training_again_after_s": 21.0, "training_again_at": 236.5},
        {"kind": "rejoin", "after_step": 27, "resumed_from_step": 27, "back": ["node-3"], "detected_at": 243.0,
         "training_again_after_s": 20.0, "training_again_at": 263.0},
        {"kind": "restart", "after_step": 33, "resumed_from_step": 30, "out": [], "detected_at": 401.2,
         "training_again_after_s": 9.0, "training_again_at": 410.2},
    ]
    rows = bf._attribute(injected, recoveries)
    assert [r["fault"] for r in rows] == ["link-5s", "link-long", "worker-kill"]
    short, long_, kill = rows
    assert short["restarts"] == 0 and short["steps_lost"] == 0 and "detected_after_s" not in short
    assert long_["restarts"] == 1 and long_["rejoins"] == 1 and long_["out"] == ["node-3"]
    assert long_["detected_after_s"] == 15.5 and long_["training_again_after_s"] == 21.0
    assert long_["rejoined_after_s"] == 23.0  # from the link back (240) to training on all nodes
    assert long_["steps_lost"] == 3
    assert kill["restarts"] == 1 and kill["detected_after_s"] == 1.2 and kill["steps_lost"] == 3


def test_run_rows_compare_at_equal_tokens():
    evals_free = [{"tokens": 0, "seconds": 0, "val_loss": 5.0}, {"tokens": 1000, "seconds": 1, "val_loss": 3.0},
                  {"tokens": 2000, "seconds": 2, "val_loss": 2.0}]
    evals_faulty = [{"tokens": 0, "seconds": 0, "val_loss": 5.0}, {"tokens": 1500, "seconds": 2, "val_loss": 2.6}]
    runs = {
        "diloco-fault-free": {"steps": 20, "tokens": 2000, "evals": evals_free, "recoveries": [], "hashes": ["a"]},
        "diloco-faults": {"steps": 20, "tokens": 1500, "evals": evals_faulty, "hashes": ["b"], "checkpoint_failures": 1,
                          "checkpoints_intact": True, "sync": {"syncs_attempted": 8, "syncs_retried": 2, "syncs_failed": 1},
                          "syncs_checked": 7, "syncs_differing": 1,
                          "recoveries": [{"kind": "restart"}, {"kind": "rejoin"}, {"kind": "restart"}],
                          "faults": [{**_fault("stop", 1.0), "hang": True}]},
    }
    (row,) = bf.run_rows(runs)
    assert row["at_tokens"] == 1500
    assert row["fault_free_val_loss"] == pytest.approx(2.5)  # halfway between 3.0 and 2.0
    assert row["val_loss"] == pytest.approx(2.6) and row["val_loss_diff_pct"] == pytest.approx(4.0)
    assert (row["restarts"], row["rejoins"], row["hangs"]) == (2, 1, 1)
    assert row["sync_failure_rate"] == pytest.approx(1 / 8) and row["syncs"] == "8/2/1"
    assert row["replicas_identical"] is True and row["syncs_agreeing"] == "6/7"
    table = bf.markdown(bf.fault_rows(runs) + [row])
    assert "| diloco | stop | node-3 |" in table and "+4.00%" in table and "| 6/7 |" in table


def test_sync_agreement_reads_every_launchs_hash_lines(tmp_path):
    # Node logs written by the launcher's own LogRouter from torchrun-prefixed lines: the sync at
    # step 5 was made by 3 ranks and agrees (rank 0 logs it again, alike, in a relaunch that redid
    # it); at step 10 rank 2 disagrees.
    from vpscluster.launch.logs import LogRouter, diloco_sync_hashes
    from vpscluster.train.strategies.diloco import sync_hash_line

    a, b = "a" * 64, "b" * 64
    router = LogRouter(tmp_path / "logs", ["node-1", "node-2"])
    for node, rank, step, outer, digest in [("node-1", 0, 5, 1, a), ("node-1", 1, 5, 1, a), ("node-2", 2, 5, 1, a),
                                            ("node-1", 0, 5, 1, a), ("node-1", 0, 10, 2, a), ("node-2", 2, 10, 2, b)]:
        router.line(node, "stdout", f"[rank{rank}]:" + sync_hash_line(0, outer, step, 3, digest))
    router.line("node-1", "stdout", "[rank0]:noise")
    router.close()
    syncs = diloco_sync_hashes(tmp_path / "logs")
    assert syncs[(3, 0, 1, 5)] == {a: {"node-1/0", "node-1/1", "node-2/2"}}
    assert syncs[(3, 0, 2, 10)] == {a: {"node-1/0"}, b: {"node-2/2"}}
    assert bf._sync_agreement(tmp_path) == {"syncs_checked": 2, "syncs_differing": 1}
    assert bf._sync_agreement(tmp_path / "nothing") == {}


def test_a_failed_run_is_a_row_that_says_so():
    runs = {"ddp-fault-free": {"evals": []}, "ddp-faults": {"failed": "the run with faults failed (x)", "faults": []}}
    assert bf.run_rows(runs) == [{"run": "ddp-faults", "failed": "the run with faults failed (x)"}]
    assert "ddp-faults (failed)" in bf.markdown(bf.run_rows(runs))


@pytest.mark.parametrize("change, match", [
    ({"strategies": "ddp,zero"}, "--strategies"),
    ({"faults": "link-5s,meteor"}, "--faults"),
    ({"faults": "node-dead,link-5s"}, "node-dead must come last"),
    ({"gap_steps": 3, "checkpoint_every": 5}, "--gap-steps"),
])
def test_bad_settings_are_refused_before_any_sandbox(change, match):
    with pytest.raises(UserError, match=match):
        bf.run_faults(bf.FaultSettings(**change))
