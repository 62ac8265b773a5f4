"""What runs on a Dask worker for one partition: the user's function, with row-level errors.

The user's function takes a list of rows (dicts) and returns a list of result rows (dicts);
`--param KEY=VALUE` arrive as keyword arguments (`def score(rows, threshold="0.5")`).
Marked with `@dataframe_fn` it takes and returns a pandas DataFrame instead; marked with
`@gpu_fn` it runs only on nodes with a GPU resource. When the function raises on a partition,
it is run again row by row to name the row: `on_error="fail"` raises `RowError` naming the
partition and the row, `"skip"` keeps the other rows' results and reports the skipped ones.
"""

from __future__ import annotations

import importlib
import os
import socket
import sys
import time
import traceback
from typing import Callable

from vpscluster.errors import UserError


class RowError(Exception):
    """The user's function failed on a row (the message is one line naming it)."""


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


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__


def run_partition(fn_spec: str, code_dir: str | None, rows: list[dict], where: dict, on_error: str,
                  params: dict | None = None) -> dict:
    """Run the function over one partition; the result rows and where and how long it ran.

    `where` is the partition (index, path, first_row, rows) for error messages; `params` are
    keyword arguments for the function (`--param KEY=VALUE`, files shipped to the node).
    """
    params = params or {}
    from vpscluster.jobs.inputs import Partition

    started = time.monotonic()
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
            raise RowError(f"partition {part.index} {at}: {_one_line(e)}{line}") from None
        skipped = [{"row": i + 1, "where": part.where(i), "error": _one_line(e)} for i, e in bad]
    from distributed import get_worker

    worker = get_worker()
    return {"rows": out, "skipped": skipped, "seconds": time.monotonic() - started,
            "worker": worker.name, "address": worker.address, "host": socket.gethostname()}
