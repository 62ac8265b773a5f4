"""`run_batch`: a batch job from start to end — check, start Dask, dispatch, write, tear down.

    check inputs, function and output folder (nothing is started for a user's mistake)
      -> start the Dask scheduler and workers on the nodes (engine)
      -> hand out partitions (dispatch) and write each result once (outputs)
      -> the manifest, then teardown on every node, whatever ended the job
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import signal
import time
import uuid
from dataclasses import asdict, dataclass, field
from typing import Callable

from vpscluster.cluster import netsafety
from vpscluster.errors import Interrupted, UserError, one_line, unless_interrupted

ON_ERROR = ("fail", "skip")
OUTPUT_FORMATS = ("jsonl", "parquet")


@dataclass
class BatchSpec:
    fn: str  # MODULE:FUNCTION
    input: str
    output: str
    partition_rows: int = 10_000
    retries: int = 2
    on_error: str = "fail"
    gpu: bool = False
    output_format: str = "jsonl"
    code_dir: str | None = None  # the folder holding the user's module (default: the current one)
    max_load: float = 0.8
    admission: bool = True
    speculation: bool = True
    workers_per_node: int | None = None
    load_interval_s: float = 1.0
    start_timeout_s: float = 120.0
    placement: str = "vpscluster"  # or "dask": Dask's own placement only (the benchmark's baseline)
    params: dict[str, str] = field(default_factory=dict)  # keyword arguments of the function
    ship: dict[str, str] = field(default_factory=dict)  # parameter -> a local file every node needs
    task_timeout_s: float | None = None  # a partition running longer fails and is retried elsewhere
    task_memory_mb: float | None = None  # a partition whose process uses more fails the job (one line)
    depth: int = 2  # partitions in flight per worker (1: hand one to a worker only once it is idle)

    def __post_init__(self) -> None:
        if self.partition_rows < 1:
            raise UserError(f"--partition-rows {self.partition_rows}: must be at least 1")
        if self.retries < 0:
            raise UserError(f"--retries {self.retries}: must be 0 or more")
        if self.on_error not in ON_ERROR:
            raise UserError(f"--on-error {self.on_error}: choose one of {', '.join(ON_ERROR)}")
        if self.output_format not in OUTPUT_FORMATS:
            raise UserError(f"--format {self.output_format}: choose one of {', '.join(OUTPUT_FORMATS)}")
        if not 0 < self.max_load <= 1.0:
            raise UserError(f"--max-load {self.max_load}: a fraction of a node's CPU, in (0, 1]")
        if self.placement not in ("vpscluster", "dask"):
            raise UserError(f"placement {self.placement!r}: choose vpscluster or dask")
        if self.task_timeout_s is not None and not self.task_timeout_s > 0:
            raise UserError(f"--task-timeout {self.task_timeout_s:g}: seconds, more than 0")
        if self.task_memory_mb is not None and not self.task_memory_mb > 0:
            raise UserError(f"--task-memory {self.task_memory_mb:g}: megabytes, more than 0")
        if self.depth < 1:
            raise UserError(f"depth {self.depth}: partitions in flight per worker, at least 1")
        if self.workers_per_node is not None and self.workers_per_node < 1:
            raise UserError(f"--workers-per-node {self.workers_per_node}: must be at least 1")


@dataclass
class BatchResult:
    ok: bool
    output: str
    partitions: int
    partitions_done: int
    partitions_resumed: int  # already finished by an earlier run, not recomputed
    rows_in: int
    rows_out: int
    wall_seconds: float
    rows_per_s: float
    partitions_per_min: float
    per_node: dict
    retries: int
    backups: int
    backups_won: int
    duplicated_rows: int
    workers_lost: list
    rows_skipped: list
    nodes: dict = field(default_factory=dict)  # node -> {"cores", "workers"}
    error: str | None = None
    interrupted: bool = False
    teardown_error: str | None = None
    moved: int = 0  # queued partitions handed to another worker before they started
    load_source: str = ""  # where admission's node load came from: "prometheus", "proc" (direct samples)

    def to_dict(self) -> dict:
        return asdict(self)


def run_batch(spec: BatchSpec, cluster, on_event: Callable[[dict], None] = lambda e: None,
              say: Callable[[str], None] = lambda s: None) -> BatchResult:
    """Run the job; never leaves a process behind. A failed job returns ok=False with `error`."""
    return asyncio.run(_run(spec, cluster, on_event, say))


def job_record(spec: BatchSpec, files, *, verbatim: bool = False) -> dict:
    """What makes a job the same job (for skipping finished partitions on a re-run).

    `--param` values are recorded by digest, never as given: the record lands in `_job.json`
    and `_manifest.json`, which outlive the job and travel with its results, and a value may
    be a token or a password. The digest still tells one job from another. (`verbatim`: the
    record as earlier versions wrote it, so their output folders are still resumed.)"""
    inputs = [{"path": f.path, "rows": f.rows, "size_bytes": f.size_bytes, "mtime_ns": f.mtime_ns} for f in files]
    params = {**spec.params, **{k: os.path.abspath(v) for k, v in spec.ship.items()}}
    # --on-error is not part of it: a job stopped by a bad row can go on with `--on-error skip`
    # (the finished partitions had no failing row).
    shown = params if verbatim else {k: param_digest(k, v) for k, v in params.items()}
    return {"fn": spec.fn, "inputs": inputs, "partition_rows": spec.partition_rows, "format": spec.output_format,
            "params": shown,
            "id": hashlib.sha256(json.dumps([spec.fn, inputs, spec.partition_rows, params]).encode()).hexdigest()[:16]}


def param_digest(key: str, value: str) -> str:
    """A parameter's value as the job record keeps it: equal values, equal digests; no value."""
    data = json.dumps([key, value]).encode()  # json: any text, even undecodable command-line bytes
    return "sha256:" + hashlib.sha256(data).hexdigest()[:16]


async def _run(spec: BatchSpec, cluster, on_event, say) -> BatchResult:
    from vpscluster.jobs import engine
    from vpscluster.jobs.inputs import find_inputs, plan_partitions
    from vpscluster.jobs.outputs import OutputLock, check_output
    from vpscluster.jobs.task import load_function

    # check: everything a user can get wrong, before anything starts.
    netsafety.require_safe_network(cluster, netsafety.DASK)  # public addresses without an overlay: refused
    code_dir = engine.check_code_dir(spec.code_dir or os.getcwd())
    fn = load_function(spec.fn, code_dir)
    gpu = spec.gpu or bool(getattr(fn, "__vpsc_gpu__", False))
    if gpu and not any(int(n.labels.get("gpus", 0) or 0) for n in cluster.nodes):
        raise UserError("--gpu: no node of the cluster has a GPU; label GPU nodes in the cluster file "
                        "(labels: {gpus: 1}) or drop --gpu")
    for key, path in spec.ship.items():
        if not os.path.isfile(path):
            raise UserError(f"{path}: no such file (needed by the function as {key!r})")
    files = find_inputs(spec.input)
    partitions = plan_partitions(files, spec.partition_rows)
    output = os.path.abspath(spec.output)
    check_output(output, job_record(spec, files), earlier=[job_record(spec, files, verbatim=True)])
    lock = OutputLock(output)  # one job per folder: refused in one line while another writes there
    try:
        return await _job(spec, cluster, on_event, say, code_dir, gpu, files, partitions, output)
    finally:
        lock.release()


async def _job(spec, cluster, on_event, say, code_dir, gpu, files, partitions, output) -> BatchResult:
    """The job, its output folder locked: start Dask, dispatch, the manifest, teardown."""
    from vpscluster.cluster.inventory import open_executors
    from vpscluster.jobs import engine
    from vpscluster.jobs.dispatch import Dispatcher, DispatchOptions
    from vpscluster.jobs.inputs import read_partitions
    from vpscluster.jobs.outputs import LOG_DIR, MANIFEST, earlier_partitions, part_name, prepare_output, write_atomic

    record = job_record(spec, files)
    resumed = prepare_output(output, record, spec.output_format, len(partitions),
                             earlier=[job_record(spec, files, verbatim=True)])
    before = earlier_partitions(output, record["id"])  # what an earlier run of this job recorded
    todo = len(partitions) - len(resumed)
    source = read_partitions(files, partitions, skip=resumed)
    # Parse the first partition now: a malformed input is a user's error before any node is touched.
    first = next(source, None)
    source = _chain(first, source)

    job_id = "batch-" + uuid.uuid4().hex[:12]
    started = time.monotonic()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    handled = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, stop.set)
            handled.append(sig)
        except (ValueError, RuntimeError):  # not the main thread
            pass
    on_event({"event": "start", "job_id": job_id, "partitions": len(partitions), "todo": todo,
              "resumed": len(resumed), "rows": sum(p.rows for p in partitions if p.index not in resumed),
              "nodes": [n.name for n in cluster.nodes]})
    dask = None
    client = None
    stats = None
    error = None
    teardown_error = None
    try:
        async with open_executors(cluster) as executors:
            try:
                if todo:
                    say(f"starting Dask on {len(executors)} node(s)")
                    dask = await unless_interrupted(engine.start(cluster, executors, job_id, code_dir,
                                                       workers_per_node=spec.workers_per_node, say=say,
                                                       timeout_s=spec.start_timeout_s,
                                                       log_dir=os.path.join(output, LOG_DIR),
                                                       params=spec.params, ship=spec.ship),
                                                      stop, "the workers were running")
                    client = await unless_interrupted(engine.connect(dask, spec.start_timeout_s), stop, "the workers were running")
                    on_event({"event": "workers", "nodes": {n: {"cores": w.cores, "workers": w.slots}
                                                             for n, w in dask.nodes.items()}})
                    opts = DispatchOptions(
                        fn=spec.fn, code_dirs=dask.code_dirs, params=dask.params, output=output, output_format=spec.output_format,
                        on_error=spec.on_error, retries=spec.retries, gpu=gpu, max_load=spec.max_load,
                        admission=spec.admission, speculation=spec.speculation,
                        load_interval_s=spec.load_interval_s, job_id=job_id, placement=spec.placement,
                        task_timeout_s=spec.task_timeout_s, task_memory_mb=spec.task_memory_mb, depth=spec.depth,
                        busy=(await asyncio.to_thread(_monitor_busy, cluster)) if spec.admission else None)
                    stats = await Dispatcher(client, dask, opts, source, on_event, stop).run()
                    error = stats.error
            except OSError as e:  # Dask's connection lost for good (CommClosedError), a log folder gone
                error = (f"the job stopped: {one_line(e)}; the finished "
                         f"partitions are kept in {output}; run the same command again to do the rest")
            finally:
                if client is not None:
                    await engine.shutdown(client, dask)
                reaped = await asyncio.shield(engine.stop(executors, dask, job_id)) if dask else []
                bad = [r for r in reaped if not r.clean]
                if bad:
                    teardown_error = "; ".join(f"{r.node}: {r.error or f'pids {r.left} still running'}" for r in bad)
    finally:
        for sig in handled:
            loop.remove_signal_handler(sig)
    interrupted = stop.is_set()
    if interrupted and error is None:
        error = "interrupted"
    from vpscluster.jobs.dispatch import Stats

    stats = stats or Stats()
    wall = time.monotonic() - started
    result = BatchResult(
        ok=error is None and teardown_error is None and stats.done == todo, output=output,
        partitions=len(partitions), partitions_done=stats.done, partitions_resumed=len(resumed),
        rows_in=stats.rows_in, rows_out=stats.rows_out, wall_seconds=round(wall, 3),
        rows_per_s=round(stats.rows_in / wall, 1) if wall > 0 else 0.0,
        partitions_per_min=round(60 * stats.done / wall, 1) if wall > 0 else 0.0,
        per_node=stats.per_node, retries=stats.retries, backups=stats.backups, backups_won=stats.backups_won,
        duplicated_rows=stats.duplicated_rows, workers_lost=stats.workers_lost, rows_skipped=stats.rows_skipped,
        nodes={n: {"cores": w.cores, "workers": w.slots} for n, w in (dask.nodes.items() if dask else [])},
        error=error, interrupted=interrupted, teardown_error=teardown_error, moved=stats.moved,
        load_source=",".join(sorted(stats.load_sources)),
    )
    # Every partition of the output: this run's, and those an earlier run finished (its records
    # where its manifest has them, else what the plan knows).
    earlier = [{**before.get(i, {"index": i, "file": part_name(i, spec.output_format), "rows_in": partitions[i].rows}),
                "resumed": True} for i in sorted(resumed)]
    manifest = {**result.to_dict(), "job": record,
                "partitions_list": sorted(stats.partitions + earlier, key=lambda p: p["index"])}
    write_atomic(os.path.join(output, MANIFEST), (json.dumps(manifest, indent=1) + "\n").encode())
    if interrupted:
        raise Interrupted(f"interrupted: {stats.done} of {todo} partitions finished and kept in {output}; "
                          "run the same command again to do the rest")
    return result


def _monitor_busy(cluster):
    """The monitoring's node load when `vpscluster monitor up` runs for the cluster, else None
    (admission then samples /proc and the cgroups itself); checked once, when the job starts."""
    from vpscluster.jobs.load import monitor_busy

    if monitor_busy(cluster) is None:
        return None
    return lambda: monitor_busy(cluster)


def _chain(first, rest):
    if first is not None:
        yield first
        yield from rest


