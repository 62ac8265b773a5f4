"""The output folder: one file per partition written atomically, the job record, the manifest.

    out/part-00000.jsonl ...   a partition's result rows (or .parquet), whole or absent:
                               written under a temporary name, fsynced, then renamed
    out/_job.json              what the job is (function, inputs and their sizes, partitioning):
                               a re-run of the same job skips the partitions already there
    out/_assignments.jsonl     one line per partition attempt: which worker and node, and why
    out/_manifest.json         at the end: every partition's rows, node, seconds and file
    out/_logs/<node>.log       the Dask scheduler's and workers' output on each node
    out/.vpsc-batch.lock       held (flock) by the job writing the folder: a second job on the
                               same --output is refused in one line, so neither can remove the
                               other's temporary files or overwrite its manifest

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
LOCK = ".vpsc-batch.lock"
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


def check_output(folder: str, job: dict, earlier: list[dict] = ()) -> None:
    """Refuse (one line) a folder that holds another job's results or other files; writes nothing.
    `earlier`: the same job as older versions recorded it."""
    path = os.path.join(folder, JOB_FILE)
    if os.path.exists(path):
        try:
            with open(path) as f:
                old = json.load(f)
        except (OSError, ValueError):
            old = None
        if old != job and old not in earlier:
            raise UserError(f"--output {folder}: holds the results of another job (function, input or "
                            "partitioning differ); choose a new --output folder or empty this one")
    elif os.path.isdir(folder) and any(not n.startswith(".") for n in os.listdir(folder)):
        raise UserError(f"--output {folder}: the folder is not empty and holds no batch job; choose a new "
                        "--output folder")


def prepare_output(folder: str, job: dict, fmt: str, partitions: int, earlier: list[dict] = ()) -> set[int]:
    """Create the folder or check it holds this same job (rewriting an `earlier` record as `job`);
    the partitions already finished. The caller holds `OutputLock`."""
    os.makedirs(folder, exist_ok=True)
    check_output(folder, job, earlier)
    path = os.path.join(folder, JOB_FILE)
    write_atomic(path, (json.dumps(job, indent=1, sort_keys=True) + "\n").encode())
    done = set()
    for i in range(partitions):
        if os.path.exists(os.path.join(folder, part_name(i, fmt))):
            done.add(i)
    for n in os.listdir(folder):  # temporary files of an interrupted run (the caller holds OutputLock)
        if n.startswith(".part-") and n.endswith(".tmp"):
            os.unlink(os.path.join(folder, n))
    return done


class OutputLock:
    """The output folder, held by this job until `release` (or this process's end, even by
    SIGKILL: the kernel drops the flock with the descriptor, so no stale lock is left behind)."""

    def __init__(self, folder: str) -> None:
        import fcntl
        import socket

        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, LOCK)
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(self._fd, 200, 0).decode(errors="replace").strip() or "another process"
            os.close(self._fd)
            raise UserError(f"--output {folder}: another batch job ({holder}) is writing there; wait for it "
                            "to end, or choose another --output folder") from None
        except OSError as e:  # a file system without locks (some network mounts)
            os.close(self._fd)
            raise UserError(f"--output {folder}: cannot lock it ({e.strerror or e}); choose an --output folder "
                            "on a local disk") from None
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # the lock file stays: removing it would race a job taking it
            self._fd = None


def earlier_partitions(folder: str, job_id: str) -> dict[int, dict]:
    """The partition records of the last manifest of this same job in `folder` ({} if none)."""
    try:
        with open(os.path.join(folder, MANIFEST)) as f:
            doc = json.load(f)
        if doc.get("job", {}).get("id") != job_id:
            return {}
        return {int(p["index"]): p for p in doc.get("partitions_list", []) if isinstance(p, dict) and "index" in p}
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return {}


class AssignmentLog:
    """Append-only record of every partition attempt (flushed per line)."""

    def __init__(self, folder: str) -> None:
        self._f = open(os.path.join(folder, ASSIGNMENTS), "a", encoding="utf-8")

    def write(self, record: dict) -> None:
        self._f.write(json.dumps(record) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()
