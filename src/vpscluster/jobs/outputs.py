"""The output folder: one file per partition written atomically, the job record, the manifest.

    out/part-00000.jsonl ...   a partition's result rows (or .parquet), whole or absent:
                               written under a temporary name, fsynced, then renamed
    out/_job.json              what the job is (function, inputs and their sizes, partitioning):
                               a re-run of the same job skips the partitions already there
    out/_assignments.jsonl     one line per partition attempt: which worker and node, and why
    out/_manifest.json         at the end: every partition's rows, node, seconds and file
    out/_logs/<node>.log       the Dask scheduler's and workers' output on each node

Only the launcher writes here, once per partition (the first result of a partition wins; a
speculative copy that finishes second is dropped), so each partition's output exists exactly
once however many times Dask ran it.
"""

from __future__ import annotations

import json
import os
import tempfile

from vpscluster.errors import UserError

JOB_FILE = "_job.json"
MANIFEST = "_manifest.json"
ASSIGNMENTS = "_assignments.jsonl"
LOG_DIR = "_logs"  # <node>.log: the Dask scheduler's and workers' output


def part_name(index: int, fmt: str) -> str:
    return f"part-{index:05d}.{fmt}"


def write_atomic(path: str, data: bytes) -> None:
    folder = os.path.dirname(path) or "."
    fd, tmp = tempfile.mkstemp(dir=folder, prefix="." + os.path.basename(path) + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def encode_rows(rows: list[dict], fmt: str) -> bytes:
    if fmt == "parquet":
        import io

        import pyarrow as pa
        import pyarrow.parquet as pq

        buf = io.BytesIO()
        pq.write_table(pa.Table.from_pylist(rows), buf)
        return buf.getvalue()
    return "".join(json.dumps(r, ensure_ascii=False, default=str) + "\n" for r in rows).encode()


def read_rows(path: str) -> list[dict]:
    """A partition file's rows (for tests and merging)."""
    if path.endswith(".parquet"):
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def prepare_output(folder: str, job: dict, fmt: str, partitions: int) -> set[int]:
    """Create the folder or check it holds this same job; the partitions already finished."""
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, JOB_FILE)
    if os.path.exists(path):
        try:
            with open(path) as f:
                old = json.load(f)
        except (OSError, ValueError):
            old = None
        if old != job:
            raise UserError(f"--output {folder}: holds the results of another job (function, input or "
                            "partitioning differ); choose a new --output folder or empty this one")
    elif any(not n.startswith(".") for n in os.listdir(folder)):
        raise UserError(f"--output {folder}: the folder is not empty and holds no batch job; choose a new "
                        "--output folder")
    write_atomic(path, (json.dumps(job, indent=1, sort_keys=True) + "\n").encode())
    done = set()
    for i in range(partitions):
        if os.path.exists(os.path.join(folder, part_name(i, fmt))):
            done.add(i)
    for n in os.listdir(folder):  # temporary files of an interrupted run
        if n.startswith(".part-") and n.endswith(".tmp"):
            os.unlink(os.path.join(folder, n))
    return done


class AssignmentLog:
    """Append-only record of every partition attempt (flushed per line)."""

    def __init__(self, folder: str) -> None:
        self._f = open(os.path.join(folder, ASSIGNMENTS), "a", encoding="utf-8")

    def write(self, record: dict) -> None:
        self._f.write(json.dumps(record) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()
