"""What runs on a Dask worker for one partition: the user's function, with row-level errors.

The user's function takes a list of rows (dicts) and returns a list of result rows (dicts);
`--param KEY=VALUE` arrive as keyword arguments (`def score(rows, threshold="0.5")`).
Marked with `@dataframe_fn` it takes and returns a pandas DataFrame instead; marked with
`@gpu_fn` it runs only on nodes with a GPU resource. When the function raises on a partition,
it is run again row by row to name the row: `on_error="fail"` raises `RowError` naming the
partition and the row, `"skip"` keeps the other rows' results and reports the skipped ones.

With limits (`--task-timeout S`, `--task-memory MB`) the partition runs in a child process of
the worker (one kept per worker thread, started on first use, tagged like the worker so
teardown finds it): the worker watches its wall time and resident memory every 50 ms and kills
it past a limit, so a runaway function costs its partition, never the worker. The child is
started again for the next partition. The limit errors (`TaskTimeout`, `TaskMemoryError`) are
one line naming the partition, the worker and the limit.
"""

from __future__ import annotations

import importlib
import os
import pickle
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import traceback
from typing import Callable

from vpscluster.errors import UserError, one_line


class RowError(Exception):
    """The user's function failed on a row (the message is one line naming it)."""


class TaskLimitError(Exception):
    """A partition went over a limit (one line); `worker` names the Dask worker it ran on."""

    def __init__(self, message: str, worker: str = "") -> None:
        super().__init__(message, worker)
        self.worker = worker

    def __str__(self) -> str:
        return self.args[0]


class TaskTimeout(TaskLimitError):
    """The partition ran longer than --task-timeout (retried elsewhere)."""


class TaskMemoryError(TaskLimitError):
    """The partition's process used more than --task-memory (not retried: it needs as much anywhere)."""


def dataframe_fn(fn: Callable) -> Callable:
    """Mark a batch function that takes and returns a pandas DataFrame."""
    fn.__vpsc_dataframe__ = True
    return fn


def gpu_fn(fn: Callable) -> Callable:
    """Mark a batch function as GPU work: it runs only on workers with a GPU resource."""
    fn.__vpsc_gpu__ = True
    return fn


def load_function(spec: str, code_dir: str | None = None) -> Callable:
    """`module:function` -> the function; `UserError` (one line) when it cannot be found."""
    module_name, sep, name = spec.partition(":")
    if not sep or not module_name or not name:
        raise UserError(f"--fn {spec}: write it as MODULE:FUNCTION, e.g. mymodule:score")
    if code_dir and code_dir not in sys.path:
        sys.path.insert(0, code_dir)
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name and module_name.startswith(e.name):
            raise UserError(f"--fn {spec}: no module {module_name!r} in {code_dir or os.getcwd()}; "
                            "run from its folder or pass --code DIR") from None
        raise UserError(f"--fn {spec}: importing {module_name} failed: No module named {e.name!r}; "
                        "install it on every node") from None
    except Exception as e:
        raise UserError(f"--fn {spec}: importing {module_name} failed: {type(e).__name__}: {e}") from None
    fn = getattr(module, name, None)
    if not callable(fn):
        raise UserError(f"--fn {spec}: {module_name} has no function {name!r}")
    return fn


def _call(fn: Callable, rows: list[dict], params: dict) -> list[dict]:
    if getattr(fn, "__vpsc_dataframe__", False):
        import pandas as pd

        out = fn(pd.DataFrame.from_records(rows), **params)
        return out.to_dict("records")
    out = fn(rows, **params)
    if not isinstance(out, list):
        raise TypeError(f"the function returned {type(out).__name__}, not a list of dicts")
    return out


def run_partition(fn_spec: str, code_dir: str | None, rows: list[dict], where: dict, on_error: str,
                  params: dict | None = None, limits: dict | None = None) -> dict:
    """Run the function over one partition; the result rows and where and how long it ran.

    `where` is the partition (index, path, first_row, rows) for error messages; `params` are
    keyword arguments for the function (`--param KEY=VALUE`, files shipped to the node);
    `limits` ({"timeout_s", "memory_mb"}, either None) run it in a watched child process.
    """
    from distributed import get_worker

    worker = get_worker()
    started = time.monotonic()
    if limits and (limits.get("timeout_s") or limits.get("memory_mb")):
        out, skipped = _run_limited(limits, str(worker.name), (fn_spec, code_dir, rows, where, on_error, params))
    else:
        out, skipped = compute(fn_spec, code_dir, rows, where, on_error, params)
    return {"rows": out, "skipped": skipped, "seconds": time.monotonic() - started,
            "worker": worker.name, "address": worker.address, "host": socket.gethostname()}


def compute(fn_spec: str, code_dir: str | None, rows: list[dict], where: dict, on_error: str,
            params: dict | None = None) -> tuple[list[dict], list[dict]]:
    """The function over one partition, here: (result rows, skipped rows); `RowError` on failure."""
    params = params or {}
    from vpscluster.jobs.inputs import Partition

    part = Partition(**where)
    fn = load_function(fn_spec, code_dir)
    skipped: list[dict] = []
    try:
        out = _call(fn, rows, params)
    except Exception as whole:
        if len(rows) == 1:
            out, bad = [], [(0, whole)]
        else:  # find the rows that fail, keep what the others give
            out, bad = [], []
            for i, row in enumerate(rows):
                try:
                    out.extend(_call(fn, [row], params))
                except Exception as e:
                    bad.append((i, e))
            if not bad:  # fails on the whole only (e.g. a batch-level assumption)
                bad = [(None, whole)]
        if on_error != "skip" or bad[0][0] is None:
            i, e = bad[0]
            at = f"row {i + 1} ({part.where(i)})" if i is not None else f"({part.where()})"
            tb = traceback.extract_tb(e.__traceback__)[-1:]
            line = f" at {os.path.basename(tb[0].filename)}:{tb[0].lineno}" if tb else ""
            raise RowError(f"partition {part.index} {at}: {one_line(e)}{line}") from None
        skipped = [{"row": i + 1, "where": part.where(i), "error": one_line(e)} for i, e in bad]
    return out, skipped


# --- partitions under limits: a watched child process --------------------------------------

_POLL_S = 0.05
_idle_children: list[subprocess.Popen] = []
_children_lock = threading.Lock()


def _send(f, obj) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    f.write(struct.pack("!Q", len(data)) + data)
    f.flush()


def _recv(f):
    head = f.read(8)
    if len(head) < 8:
        raise EOFError
    (n,) = struct.unpack("!Q", head)
    data = f.read(n)
    if len(data) < n:
        raise EOFError
    return pickle.loads(data)


def _rss_mb(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        return 0.0


def _child() -> subprocess.Popen:
    with _children_lock:
        if _idle_children:
            return _idle_children.pop()
    # The worker's environment (PYTHONPATH, the job's tag) goes with it; its stderr is the worker's log.
    return subprocess.Popen([sys.executable, "-c", "from vpscluster.jobs.task import serve; serve()"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0)


def _kill(proc: subprocess.Popen) -> None:
    try:
        proc.kill()
        proc.wait(timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        pass


def _run_limited(limits: dict, worker: str, job: tuple) -> tuple[list[dict], list[dict]]:
    from vpscluster.jobs.inputs import Partition

    timeout_s, memory_mb = limits.get("timeout_s"), limits.get("memory_mb")
    part = Partition(**job[3])
    proc = _child()
    try:
        _send(proc.stdin, job)
    except OSError:  # a child that died while idle: start another
        _kill(proc)
        proc = _child()
        _send(proc.stdin, job)
    started = time.monotonic()
    peak = 0.0
    while True:
        ready, _, _ = select.select([proc.stdout], [], [], _POLL_S)
        if ready:
            try:
                ok, value = _recv(proc.stdout)
            except (EOFError, OSError):
                ok, value = None, None
            if ok is not None:
                with _children_lock:
                    _idle_children.append(proc)
                if ok:
                    return value
                raise value
        if proc.poll() is not None or ready:  # died without an answer
            _kill(proc)
            code = proc.returncode
            how = f"signal {signal.Signals(-code).name}" if code and code < 0 else f"exit status {code}"
            raise RuntimeError(f"partition {part.index} ({part.where()}): the process running it on {worker} "
                               f"ended ({how}) without a result")
        if memory_mb:
            peak = max(peak, _rss_mb(proc.pid))
            if peak > memory_mb:
                _kill(proc)
                raise TaskMemoryError(f"partition {part.index} ({part.where()}) used {peak:.0f} MB on {worker}, over "
                                      f"--task-memory {memory_mb:g} MB; raise --task-memory or lower --partition-rows",
                                      worker)
        if timeout_s and time.monotonic() - started > timeout_s:
            _kill(proc)
            raise TaskTimeout(f"partition {part.index} ({part.where()}) ran longer than --task-timeout {timeout_s:g} s "
                              f"on {worker}; raise --task-timeout or lower --partition-rows", worker)


def serve() -> None:
    """The child's loop: read a partition, run it, answer; until the worker closes the pipe."""
    inp = sys.stdin.buffer
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # the function's prints go to the worker's log, not into the answers
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the worker (or teardown) ends it
    while True:
        try:
            job = _recv(inp)
        except (EOFError, OSError):
            return
        try:
            answer = (True, compute(*job))
        except Exception as e:
            answer = (False, e)
        try:
            _send(out, answer)
        except (pickle.PicklingError, TypeError, AttributeError) as e:  # an exception or row pickle cannot carry
            _send(out, (False, RuntimeError(one_line(answer[1]) if not answer[0] else f"result rows: {one_line(e)}")))
