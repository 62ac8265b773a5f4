"""`bench torchft`'s verdicts from the replicas' sync lines (the run itself needs torchft and is
recorded in BENCHMARKS.md; here the arithmetic on made-up lines of 3 replicas, one killed)."""

from __future__ import annotations

import pytest

from vpscluster.bench.torchft_check import summarize


def lines(mismatch_at: int | None = None, rejoin_equal: bool = True) -> list[dict]:
    out = []
    for step in range(1, 21):  # a sync every 1 s; replica 2 killed at 5.5 s, started at 11.2 s, first sync step 13
        t = float(step) + (1.0 if step >= 6 else 0.0)  # the kill costs the survivors one extra second
        reps = ["0", "1"] + (["2"] if step <= 5 or step >= 13 else [])
        for r in reps:
            h = f"h{step}"
            if step == mismatch_at and r == "1":
                h = "other"
            if step >= 13 and r == "2" and not rejoin_equal:
                h = "stale"
            out.append({"t": t + 0.01 * int(r), "replica": r, "step": step, "participants": len(reps), "hash": h})
    return out


def test_a_clean_run_passes_every_check():
    sm = summarize(lines(), victim=2, replicas=3, killed=5.5, restarted=11.2)
    assert sm["outer_syncs"] == 20 and sm["mismatched_syncs"] == 0
    assert sm["syncs_with_fewer_replicas"] == 7  # steps 6..12
    assert sm["survivor_median_gap_s"] == pytest.approx(1.0) and sm["survivor_pause_at_kill_s"] == pytest.approx(2.0)
    assert sm["victim_first_sync_after_start_s"] == pytest.approx(14.02 - 11.2)
    assert sm["victim_healed_to_step"] == 13 and sm["victim_equal_after_rejoin"] is True
    assert sm["participants_min"] == 2


def test_differing_weights_and_a_stale_rejoin_are_caught():
    assert summarize(lines(mismatch_at=8), 2, 3, 5.5, 11.2)["mismatched_syncs"] == 1
    sm = summarize(lines(rejoin_equal=False), 2, 3, 5.5, 11.2)
    assert sm["victim_equal_after_rejoin"] is False and sm["mismatched_syncs"] == 8
