"""Input data as horizontal partitions: JSONL, CSV, Parquet, text, or a folder of them.

A partition is up to `partition_rows` consecutive rows of one file (partitions never span
files, so every row is named by file and row number in errors). Files are read as a stream,
one partition at a time: memory holds the partitions in flight, whatever the input size.
A first pass counts rows (line counts; Parquet metadata) so progress has a total.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Iterator

from vpscluster.errors import UserError

FORMATS = {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "jsonl", ".csv": "csv", ".parquet": "parquet",
           ".pq": "parquet", ".txt": "text", ".text": "text"}


@dataclass(frozen=True)
class InputFile:
    path: str
    format: str
    rows: int
    size_bytes: int
    mtime_ns: int


@dataclass(frozen=True)
class Partition:
    index: int
    path: str
    first_row: int  # 0-based, within the file
    rows: int

    def where(self, row: int | None = None) -> str:
        name = os.path.basename(self.path)
        if row is None:
            return f"{name} rows {self.first_row + 1}-{self.first_row + self.rows}"
        return f"{name} row {self.first_row + row + 1}"

    def to_dict(self) -> dict:
        return {"index": self.index, "path": self.path, "first_row": self.first_row, "rows": self.rows}


def find_inputs(path: str) -> list[InputFile]:
    """The input files (a folder: its files of known formats, sorted by name), rows counted."""
    if not os.path.exists(path):
        raise UserError(f"--input {path}: no such file or folder")
    if os.path.isdir(path):
        names = sorted(n for n in os.listdir(path) if not n.startswith(".") and _format_of(n))
        paths = [os.path.join(path, n) for n in names]
        if not paths:
            raise UserError(f"--input {path}: no input files in it (known: {', '.join(sorted(FORMATS))})")
    else:
        if not _format_of(path):
            raise UserError(f"--input {path}: unknown format; name it *.jsonl, *.csv, *.parquet or *.txt")
        paths = [path]
    files = []
    for p in paths:
        try:
            st = os.stat(p)
            files.append(InputFile(os.path.abspath(p), _format_of(p), _count_rows(p, _format_of(p)),
                                   st.st_size, st.st_mtime_ns))
        except OSError as e:
            raise UserError(f"--input {p}: cannot read it ({e.strerror or e}); check the path and permissions") from None
    return files


def _format_of(path: str) -> str | None:
    return FORMATS.get(os.path.splitext(path)[1].lower())


def _count_rows(path: str, fmt: str) -> int:
    if fmt == "parquet":
        import pyarrow.parquet as pq

        try:
            return pq.ParquetFile(path).metadata.num_rows
        except Exception as e:  # pyarrow raises its own errors for a corrupt file
            raise UserError(f"--input {path}: not a readable Parquet file ({str(e).splitlines()[0]})") from None
    if fmt == "csv":
        import pandas as pd

        try:
            return sum(len(c) for c in pd.read_csv(path, chunksize=100_000, usecols=[0]))
        except Exception as e:
            raise UserError(f"--input {path}: not a readable CSV file ({str(e).splitlines()[0]})") from None
    with open(path, "rb") as f:
        return sum(1 for line in f if line.strip())


def plan_partitions(files: list[InputFile], partition_rows: int) -> list[Partition]:
    parts = []
    for f in files:
        for start in range(0, f.rows, partition_rows):
            parts.append(Partition(len(parts), f.path, start, min(partition_rows, f.rows - start)))
    return parts


def read_partitions(files: list[InputFile], partitions: list[Partition], skip: set[int]) -> Iterator[tuple[Partition, list[dict]]]:
    """(partition, rows) in order, one file pass each; partitions in `skip` are not parsed."""
    by_file: dict[str, list[Partition]] = {}
    for p in partitions:
        by_file.setdefault(p.path, []).append(p)
    for f in files:
        parts = by_file.get(f.path, [])
        if not parts:
            continue
        chunks = _chunks(f, parts[0].rows if parts else 1)
        for part in parts:
            rows = next(chunks, None)
            if rows is None:
                raise UserError(f"--input {f.path}: the file changed while the job ran (fewer rows than counted)")
            if part.index not in skip:
                yield part, rows


def _chunks(f: InputFile, n: int) -> Iterator[list[dict]]:
    if f.format == "parquet":
        import pyarrow.parquet as pq

        buf: list[dict] = []
        for batch in pq.ParquetFile(f.path).iter_batches(batch_size=n):
            buf.extend(batch.to_pylist())  # batches end at row groups too: re-cut to n rows
            while len(buf) >= n:
                yield buf[:n]
                buf = buf[n:]
        if buf:
            yield buf
        return
    if f.format == "csv":
        import pandas as pd

        for df in pd.read_csv(f.path, chunksize=n):
            yield df.astype(object).where(df.notna(), None).to_dict("records")
        return
    with open(f.path, encoding="utf-8", errors="strict") as fh:
        rows: list[dict] = []
        line_no = 0
        try:
            for line_no, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                rows.append(_parse_line(line, f, line_no))
                if len(rows) == n:
                    yield rows
                    rows = []
        except UnicodeDecodeError:
            raise UserError(f"--input {f.path}: line {line_no + 1} is not UTF-8 text") from None
        if rows:
            yield rows


def _parse_line(line: str, f: InputFile, line_no: int) -> dict:
    if f.format == "text":
        return {"text": line.rstrip("\r\n")}
    try:
        row = json.loads(line)
    except ValueError as e:
        raise UserError(f"--input {f.path}: line {line_no} is not JSON ({e.msg}); fix or remove that line") from None
    if not isinstance(row, dict):
        raise UserError(f"--input {f.path}: line {line_no} is not a JSON object; each line must be one row {{...}}")
    return row

