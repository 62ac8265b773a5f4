"""bench overlap's rows and table (the measurement itself runs as `vpscluster bench overlap`)."""

from __future__ import annotations

import pytest

from vpscluster.bench.overlap import COLUMNS, DEFAULT_ROWS, markdown_table, parse_rows
from vpscluster.errors import UserError


def test_rows_are_wire_at_rate():
    assert parse_rows("int8@100mbit, bf16@1gbit") == [("int8", "100mbit"), ("bf16", "1gbit")]
    assert len(parse_rows(DEFAULT_ROWS)) == 5
    for bad, words in [("int4@100mbit", "not WIRE@RATE"), ("int8", "not WIRE@RATE"), ("int8@fast", "not a rate"),
                       (" , ", "at least one")]:
        with pytest.raises(UserError, match=words):
            parse_rows(bad)


def test_the_table_marks_a_failed_row_and_formats_the_rest():
    rows = [{"row": "int8-100mbit", "sync_mb": 16.33, "sync_s": 1.306, "step_s": 2.1, "ratio": 0.622, "hidden": "yes",
             "busy_s": 1.79, "steps": 141, "tokens_per_s": 1883.3, "util": 0.9812, "util_wall": 0.9811},
            {"row": "bf16-100mbit", "sync_mb": 32.5, "sync_s": 2.6, "failed": "train failed"}]
    text = markdown_table(rows)
    lines = text.splitlines()
    assert len(lines) == 4 and lines[0].count("|") == len(COLUMNS) + 1
    assert "| int8-100mbit | 16.3 | 1.31 | 2.10 | 0.62 | yes | 1.79 | 141 | 1883 | 98.1% | 98.1% |" == lines[2]
    assert lines[3].startswith("| bf16-100mbit (failed) | 32.5 | 2.60 | — |")


def test_the_cli_renders_the_rows_as_a_rich_table():
    from rich.console import Console

    from vpscluster.bench.overlap import cell
    from vpscluster.cli.bench import rich_table

    rows = [{"row": "int8-100mbit", "sync_mb": 16.33, "sync_s": 1.306, "step_s": 2.1, "ratio": 0.622, "hidden": "yes",
             "busy_s": 1.79, "steps": 141, "tokens_per_s": 1883.3, "util": 0.9812, "util_wall": 0.9811}]
    t = rich_table("bench overlap", rows, COLUMNS, cell, left=("row",))
    assert [c.header for c in t.columns] == [h for _, h, _ in COLUMNS]
    assert [c.justify for c in t.columns] == ["left"] + ["right"] * (len(COLUMNS) - 1)
    con = Console(record=True, width=250)
    con.print(t)
    text = con.export_text()
    assert "int8-100mbit" in text and "98.1%" in text and "1883" in text
