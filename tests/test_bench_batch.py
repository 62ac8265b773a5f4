"""The batch benchmark's arithmetic and work function (the benchmark itself runs on a sandbox
with CPU hogs: `vpscluster bench batch`, not a test)."""

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
    rows = [{"mode": "static", "makespan_s": 30.0, "vs_ideal": 3.0, "rows_per_s": 10.0, "duplicated_rows_share": 0.0,
             "idle_share": {"node-1": 0.5}, "partitions_per_node": {"node-1": 1}}]
    table = markdown_table(rows)
    assert table.splitlines()[2].startswith("| static | 30.0 | 3.00 | 10.0 | 0.0% | node-1:50% | node-1:1 |")
