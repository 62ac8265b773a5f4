"""Batch jobs over partitioned data on Dask distributed, with load-aware scheduling.

    from vpscluster.jobs import BatchSpec, run_batch
    result = run_batch(BatchSpec(fn="mymodule:score", input="comments.jsonl", output="out/"), cluster)

A batch function takes one partition as a list of rows (dicts) and returns a list of result
rows (dicts). Decorate it with `@dataframe_fn` to take and return a pandas DataFrame, with
`@gpu_fn` to run it only on nodes with a GPU. Modules: `inputs` (partitions), `engine` (Dask on
the nodes), `dispatch` (admission, speculation, retries), `outputs` (atomic, exactly once),
`load` (node load samples), `task` (what runs on a worker), `examples` (bundled jobs).
"""

from __future__ import annotations

from vpscluster.jobs.task import dataframe_fn, gpu_fn

__all__ = ["BatchSpec", "run_batch", "dataframe_fn", "gpu_fn"]


def __getattr__(name: str):
    if name in ("BatchSpec", "run_batch", "BatchResult"):
        from vpscluster.jobs import run

        return getattr(run, name)
    raise AttributeError(name)
