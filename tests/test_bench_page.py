"""BENCHMARKS.md's front tables: `bench overlap --update-benchmarks` rewrites its block between
the page's markers and nothing else (on a temp file; the measurement itself needs a sandbox)."""

from __future__ import annotations

import calendar
import time
from pathlib import Path

import pytest

from vpscluster.bench import overlap, page
from vpscluster.errors import UserError

# The rows of the recorded run (BENCHMARKS.md, overlap, 2026-12-06 00:53–01:21 UTC).
ROWS = [
    {"row": "int8-100mbit", "sync_mb": 16.33, "sync_s": 1.31, "step_s": 2.12, "ratio": 0.62, "hidden": "yes",
     "busy_s": 1.79, "steps": 141, "tokens_per_s": 1897, "util": 0.984, "util_wall": 0.982},
    {"row": "int8-80mbit", "sync_mb": 16.33, "sync_s": 1.63, "step_s": 2.13, "ratio": 0.77, "hidden": "yes",
     "busy_s": 2.23, "steps": 141, "tokens_per_s": 1876, "util": 0.976, "util_wall": 0.974},
    {"row": "int8-58mbit", "sync_mb": 16.33, "sync_s": 2.25, "step_s": 2.12, "ratio": 1.06, "hidden": "no",
     "busy_s": 3.12, "steps": 131, "tokens_per_s": 1788, "util": 0.929, "util_wall": 0.927},
]


def utc(text: str) -> float:
    return calendar.timegm(time.strptime(text, "%Y-%m-%d %H:%M"))


def doc(rows=ROWS, started="2026-12-06 00:53", ended="2026-12-06 01:21") -> dict:
    return {"headroom": 0.8, "rows": rows, "started": utc(started), "ended": utc(ended),
            "machine": {"cpu": "AMD EPYC", "cpus": 2, "kernel": "6.18.44", "python": "3.11.7", "os": "Debian GNU/Linux 12 (bookworm)"},
            "load_average": {"start": 0.8, "end": 2.6}}


PAGE = """# Benchmarks

## overlap

Prose by hand.

<!-- rows: overlap -->
| target | result | met? | date | command | machine |
|---|---|---|---|---|---|
| old row |
<!-- end rows: overlap -->

What it means: by hand.

<!-- section: plan (vpscluster bench plan) -->
plan's own block
<!-- end: plan -->
"""


def test_update_rewrites_only_the_overlap_block(tmp_path):
    f = tmp_path / "BENCHMARKS.md"
    f.write_text(PAGE)
    command = "vpscluster bench overlap --out bench/results/overlap1 --update-benchmarks"
    page.write_rows(f, "overlap", overlap.benchmarks_block(doc(), command))
    text = f.read_text()
    assert "old row" not in text
    before, _, rest = text.partition("<!-- rows: overlap -->\n")
    block, _, after = rest.partition("<!-- end rows: overlap -->")
    assert before == PAGE.partition("<!-- rows: overlap -->\n")[0]
    assert after == PAGE.partition("<!-- end rows: overlap -->")[2]  # the prose and plan's block stay
    lines = block.splitlines()
    assert lines[0] == "| target | result | met? | date | command | machine |"
    row = lines[2]
    assert row.count(" | ") == 5
    assert ("utilisation (at the sync's length ÷ τ steps): int8-100mbit 98.4% at 0.62; int8-80mbit 97.6% at 0.77; "
            "int8-58mbit 92.9% at 1.06") in row
    assert "| **met**: every row within the 80% headroom kept ≥ 95% |" in row
    assert f"| 2026-12-06 00:53–01:21 UTC | `{command}` |" in row
    assert row.endswith("| 2-core AMD EPYC, Debian GNU/Linux 12 (bookworm), Linux 6.18.44, Python 3.11.7; "
                        "load average 0.8 at the start, 2.6 at the end |")
    # then the run's rows, in the bench's own table
    assert lines[4].startswith("| row | sync MB/rank |")
    assert "| int8-80mbit | 16.3 | 1.63 | 2.13 | 0.77 | yes | 2.23 | 141 | 1876 | 97.6% | 97.4% |" in lines
    # a second run replaces the first, still between the same markers
    page.write_rows(f, "overlap", overlap.benchmarks_block(doc(ROWS[:1]), "vpscluster bench overlap --rows int8@100mbit"))
    text2 = f.read_text()
    assert text2.count("<!-- rows: overlap -->") == 1 and "int8-80mbit" not in text2 and "--rows int8@100mbit" in text2


def test_the_met_cell_says_missed_and_why_or_that_nothing_counts():
    low = [dict(ROWS[1], util=0.931)]
    assert "**missed**: int8-80mbit (0.77 of a step) gave 93.1%" in overlap.front_row(doc(low), "c")[2]
    beyond = [ROWS[2]]
    assert overlap.front_row(doc(beyond), "c")[2] == "—: no row's sync within the 80% headroom"
    failed = [{"row": "bf16-100mbit", "sync_mb": 32.5, "sync_s": 2.6, "failed": "train failed"}]
    cells = overlap.front_row(doc(failed), "c")
    assert cells[2] == "—: no row finished" and "bf16-100mbit failed" in cells[1]
    cells = overlap.front_row(doc(ROWS[:1] + failed), "c")
    assert cells[2].startswith("**met**") and cells[2].endswith("(1 row(s) failed)")


def test_a_run_across_midnight_gives_both_dates_and_cells_cannot_break_the_table():
    cells = overlap.front_row(doc(started="2026-12-04 23:55", ended="2026-12-05 00:04"), "vpscluster bench overlap --rows a|b")
    assert cells[3] == "2026-12-04 23:55–2026-12-05 00:04 UTC"
    row = page.table([cells]).splitlines()[2]
    assert "--rows a\\|b" in row and row.count(" | ") == 5


def test_missing_file_or_markers_are_refused_up_front(tmp_path):
    with pytest.raises(UserError, match="no such file to write the overlap table into"):
        page.check(tmp_path / "BENCHMARKS.md", "overlap")
    f = tmp_path / "BENCHMARKS.md"
    f.write_text("# Benchmarks\n<!-- rows: overlap -->\nno end marker\n")
    with pytest.raises(UserError, match="markers are missing"):
        page.write_rows(f, "overlap", "x")
    assert f.read_text() == "# Benchmarks\n<!-- rows: overlap -->\nno end marker\n"


def test_the_cli_takes_the_flags():
    import argparse

    from vpscluster.cli import bench_overlap

    p = argparse.ArgumentParser()
    bench_overlap.add_arguments(p)
    args = p.parse_args(["--update-benchmarks", "--benchmarks", "B.md"])
    assert args.update_benchmarks and args.benchmarks == "B.md"
    assert not p.parse_args([]).update_benchmarks and p.parse_args([]).benchmarks == "BENCHMARKS.md"


def test_the_project_page_keeps_the_markers_the_benches_write_between():
    """BENCHMARKS.md holds the blocks that `bench overlap --update-benchmarks` and `bench plan` write."""
    from vpscluster.bench import plan

    text = (Path(__file__).resolve().parents[1] / "BENCHMARKS.md").read_text()
    assert page._span(text, "overlap") is not None
    assert 0 <= text.find(plan.MARK_START) < text.find(plan.MARK_END)
