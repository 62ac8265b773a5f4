"""The batch benchmark's arithmetic, work function and capacity measurement (the benchmark itself
runs on a sandbox with CPU hogs: `vpscluster bench batch`, not a test)."""

from __future__ import annotations

import pytest

from vpscluster.bench.batch import burn, ideal_makespan, markdown_table


def test_ideal_makespan_counts_the_hogged_share():
    cores = [0.45, 0.45, 0.45, 0.15]  # 1.5 cores
    assert ideal_makespan(15.0, cores, hog_after_s=20.0, hogs=3) == pytest.approx(10.0)  # done before the hog
    # 30 CPU-s before the hog (20 s x 1.5); the rest at 1.5 - 0.45 * 3/4 = 1.1625 cores.
    assert ideal_makespan(60.0, cores, hog_after_s=20.0, hogs=3) == pytest.approx(20.0 + 30.0 / 1.1625)


def test_burn_is_deterministic_work_per_row():
    a = burn([{"id": 1, "work": 10}, {"id": 2, "work": 10}])
    assert a == burn([{"id": 1, "work": 10}, {"id": 2, "work": 10}])
    assert [r["id"] for r in a] == [1, 2] and a[0]["h"] != a[1]["h"]


def test_markdown_table_has_a_row_per_mode():
    rows = [{"mode": "static", "makespan_s": 30.0, "vs_ideal": 3.0, "vs_measured": 2.5, "rows_per_s": 10.0,
             "duplicated_rows_share": 0.0,
             "idle_share": {"node-1": 0.5}, "partitions_per_node": {"node-1": 1}}]
    table = markdown_table(rows)
    assert table.splitlines()[2].startswith("| static | 30.0 | 3.00 | 2.50 | 10.0 | 0.0% | node-1:50% | node-1:1 |")


@pytest.mark.sandbox
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_measured_capacity_follows_the_quotas(make_sandbox):
    from vpscluster.bench.batch import measure_capacity

    info = make_sandbox(nodes=2, bandwidth="1gbit", cpu="0.5,0.125")
    rates = measure_capacity(info.nodes, work=20_000, seconds=3.0)
    assert len(rates) == 2 and min(rates) > 0
    # 4x the quota, several times the rows: not exactly 4x, as CFS serves a small quota worse
    # (CI measured 6.2x for 0.5 against 0.125: the loss the yardstick exists to capture)
    assert 2.5 < rates[0] / rates[1] < 9.0, rates
    # the best of three, since a noisy neighbour only ever slows the yardstick (CI on 2026-12-07
    # got 73.5 rows/s from one "unthrottled" run against 56.3 on the half-core node)
    alone = max(unthrottled_rate(work=20_000, seconds=2.0) for _ in range(3))
    assert rates[0] < 0.75 * alone, (rates, alone)  # the half-core quota is felt


def unthrottled_rate(work: int, seconds: float) -> float:
    """Rows/s of the same probe in a fresh process outside any quota, right after the nodes'.
    (This test used to time `burn` in its own process, deep into a full test session: CI on
    2026-12-05 got 97.7 rows/s "unthrottled" against 80.6 on the half-core node and 20.0 on the
    eighth-core one - the nodes 4.0x apart as their quotas, a whole core barely faster than half
    of one - so the yardstick, not the quota, was off, and the check failed.)"""
    import subprocess
    import sys

    from vpscluster.bench.batch import _CAPACITY_PROBE

    out = subprocess.run([sys.executable, "-c", _CAPACITY_PROBE, str(work), str(seconds)], capture_output=True,
                         text=True, timeout=seconds + 60, check=True)
    return float(out.stdout.strip())
