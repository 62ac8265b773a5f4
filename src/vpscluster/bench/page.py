"""BENCHMARKS.md's front tables, written by `vpscluster bench NAME --update-benchmarks`.

A benchmark whose bench can write its own table has a block between two marker comments:

    <!-- rows: overlap -->
    | target | result | met? | date | command | machine |
    |---|---|---|---|---|---|
    | ... |
    <!-- end rows: overlap -->

`write_rows(path, name, body)` replaces what lies between one benchmark's markers and nothing
else. The prose around the block, and the dated history in bench/history/, stay by hand.
`check(path, name)` says up front, before a long run, when the file or its markers are missing.
"""

from __future__ import annotations

import os
import platform
import time
from pathlib import Path
from typing import Any, Sequence

HEADER = ("target", "result", "met?", "date", "command", "machine")


def markers(name: str) -> tuple[str, str]:
    return f"<!-- rows: {name} -->", f"<!-- end rows: {name} -->"


def _span(text: str, name: str) -> tuple[int, int] | None:
    start_mark, end_mark = markers(name)
    start = text.find(start_mark)
    end = text.find(end_mark, start + len(start_mark)) if start >= 0 else -1
    return (start + len(start_mark), end) if start >= 0 and end >= 0 else None


def check(path: str | Path, name: str) -> None:
    """Refuse, with the fix in one line, when `path` lacks the file or `name`'s markers."""
    from vpscluster.errors import UserError

    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path}: no such file to write the {name} table into; run from the project folder, "
                        "pass --benchmarks FILE, or leave out --update-benchmarks")
    if _span(path.read_text(), name) is None:
        start_mark, end_mark = markers(name)
        raise UserError(f"{path}: the {name} table's markers are missing; restore `{start_mark}` and `{end_mark}`")


def write_rows(path: str | Path, name: str, body: str) -> None:
    """Replace what lies between `name`'s markers in `path` with `body` (nothing else changes)."""
    from vpscluster.fsutil import write_atomic

    check(path, name)
    text = Path(path).read_text()
    start, end = _span(text, name)  # type: ignore[misc]  # check() found it
    write_atomic(path, text[:start] + "\n" + body.strip("\n") + "\n" + text[end:])


def _cell(value: Any) -> str:
    return " ".join(str(value).split()).replace("|", "\\|")


def table(rows: Sequence[Sequence[Any]], header: Sequence[str] = HEADER) -> str:
    """A Markdown table; a `|` inside a cell is escaped and line breaks become spaces."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def utc_span(start: float, end: float) -> str:
    """`2026-12-06 00:53–01:21 UTC`; the end's date too when the run crossed midnight."""
    a, b = time.gmtime(start), time.gmtime(end)
    tail = time.strftime("%H:%M", b) if a[:3] == b[:3] else time.strftime("%Y-%m-%d %H:%M", b)
    return f"{time.strftime('%Y-%m-%d %H:%M', a)}–{tail} UTC"


def os_name() -> str:
    try:
        for line in Path("/etc/os-release").read_text().splitlines():
            if line.startswith("PRETTY_NAME="):
                return line.partition("=")[2].strip().strip('"')
    except OSError:
        pass
    return platform.system()


def machine_line(machine: dict[str, Any], load: Sequence[float] | None = None) -> str:
    """This machine in the page's words: cores, CPU, OS, kernel, Python, and the load around the run."""
    text = (f"{machine.get('cpus', os.cpu_count())}-core {machine.get('cpu') or 'CPU'}, {machine.get('os') or os_name()}, "
            f"Linux {machine.get('kernel', platform.release())}, Python {machine.get('python', platform.python_version())}")
    if load:
        text += f"; load average {load[0]:.1f} at the start, {load[1]:.1f} at the end"
    return text
