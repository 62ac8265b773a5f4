"""One Markdown table for every benchmark: COLUMNS are (key, header, format) triples."""

from __future__ import annotations

from typing import Any, Callable

Columns = list[tuple[str, str, str]]


def cell(row: dict[str, Any], key: str, fmt: str, name_key: str | None = None) -> str:
    """A row's value for `key`, formatted; "—" when missing; the row's name marked when it failed."""
    v = row.get(key)
    if name_key is not None and key == name_key and row.get("failed"):
        return f"{v} (failed)"
    return "—" if v is None else fmt.format(v)


def markdown(rows: list[dict[str, Any]], columns: Columns, cell_fn: Callable[[dict, str, str], str] = cell) -> str:
    lines = ["| " + " | ".join(h for _, h, _ in columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell_fn(r, k, f) for k, _, f in columns) + " |" for r in rows]
    return "\n".join(lines)
