"""The batch benchmark: static split, plain Dask and vpscluster batch on uneven, changing nodes.

    run_batch_bench(BatchBenchSettings(...), say=print) -> results document
    (CLI: `vpscluster bench batch`)

Brings up a sandbox with uneven CPU quotas (default 0.45, 0.45, 0.45, 0.15 of a core), makes a
CPU-bound input (each row costs `work` rounds of sha256: the same work everywhere), and runs
the same job three ways, one after the other, each with a foreign CPU hog (`hogs` busy
processes) started inside the first node's cgroup `hog_after_s` seconds into the run:

- `static`: an equal split, one partition per node (what `split -n N` and N SSH sessions do);
- `dask`: every partition handed to Dask's scheduler at once (its queuing and work stealing,
  no admission, no speculation);
- `vpscluster`: `vpscluster batch` as shipped (admission at `max_load`, speculation);
- `vpscluster-depth1` (only when asked for with `--modes`): the same with one partition in
  flight per worker (handed out once the worker is idle: the dispatch before queue depth 2).

For each: makespan and its ratio to the ideal — total work over the CPU actually available to
the job (each node's quota; on the hogged node, after the hog starts, the fair share 1/(hogs+1)
of it) — and to the measured capacity (the same, from the rows/s each node delivers to one busy
`burn` process in its cgroup with all nodes busy at once: CFS throttling and the shared cores
included, Dask's overhead not), rows/s, each node's idle share (1 - busy seconds / makespan / workers), and the rows
computed twice (speculation). The work per row is calibrated here first (CPU seconds per row
in one process). Results: `out` (default bench/results/batch-<time>/): results.json, table.md.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

from vpscluster.bench import table
from vpscluster.cluster.sandbox.cgroup import enter_argv

MODES = ("static", "dask", "vpscluster", "vpscluster-depth1")
DEFAULT_MODES = ("static", "dask", "vpscluster")


@dataclass
class BatchBenchSettings:
    name: str = "bj-bench"
    cpu: str = "0.45,0.45,0.45,0.15"
    rows: int = 2000
    work: int = 100_000  # sha256 rounds per row (~50 ms of one core here: ~100 s of CPU in all)
    partition_rows: int = 20
    hog_after_s: float = 10.0
    hogs: int = 3
    max_load: float = 0.8
    modes: str = ",".join(DEFAULT_MODES)
    out: str | None = None


def burn(rows: list[dict]) -> list[dict]:
    """The benchmark's work: `work` rounds of sha256 per row (pure CPU, deterministic)."""
    out = []
    for r in rows:
        h = str(r["id"]).encode()
        for _ in range(int(r["work"])):
            h = hashlib.sha256(h).digest()
        out.append({"id": r["id"], "h": h.hex()[:16]})
    return out


def calibrate(work: int, rows: int = 50) -> float:
    """CPU seconds per row of `work` rounds, in this process."""
    start = time.process_time()
    burn([{"id": i, "work": work} for i in range(rows)])
    return (time.process_time() - start) / rows


def ideal_makespan(total_cpu_s: float, cores: list[float], hog_after_s: float, hogs: int) -> float:
    """Seconds for `total_cpu_s` of work on `cores`, the first node's share cut to 1/(hogs+1)
    from `hog_after_s` on (the CPU actually available to the job)."""
    full = sum(cores)
    if total_cpu_s <= full * hog_after_s:
        return total_cpu_s / full
    after = full - cores[0] * hogs / (hogs + 1)
    return hog_after_s + (total_cpu_s - full * hog_after_s) / after


_CAPACITY_PROBE = """
import sys, time
from vpscluster.bench.batch import burn
work, seconds = int(sys.argv[1]), float(sys.argv[2])
rows, start = 0, time.monotonic()
while time.monotonic() - start < seconds:
    burn([{"id": rows, "work": work}])
    rows += 1
print(rows / (time.monotonic() - start))
"""


def measure_capacity(nodes, work: int, seconds: float = 5.0) -> list[float]:
    """Rows per second that each sandbox node delivers to one busy process running `burn` inside
    its namespace and CPU cgroup, all nodes at once (as in the job: they share this machine's
    cores). What the quotas promise, less what CFS throttling and the shared cores take."""
    procs = []
    try:
        for node in nodes:
            procs.append(subprocess.Popen(
                enter_argv(node.cgroup, node.namespace, [sys.executable, "-c", _CAPACITY_PROBE, str(work), str(seconds)]),
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True))
        return [float(p.communicate(timeout=seconds + 60)[0].strip()) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)


def run_batch_bench(settings: BatchBenchSettings, say: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    from vpscluster.cluster import sandbox
    from vpscluster.cluster.inventory import load_cluster

    modes = [m.strip() for m in settings.modes.split(",") if m.strip()]
    from vpscluster.errors import UserError

    bad = [m for m in modes if m not in MODES]
    if bad:
        raise UserError(f"--modes {','.join(bad)}: choose from {', '.join(MODES)}")
    out = Path(settings.out or Path("bench/results") / ("batch-" + time.strftime("%Y%m%d-%H%M%S", time.gmtime())))
    out.mkdir(parents=True, exist_ok=True)
    data = out / "input.jsonl"
    data.write_text("".join(json.dumps({"id": i, "work": settings.work}) + "\n" for i in range(settings.rows)))
    cpu_s_per_row = calibrate(settings.work)
    say(f"calibrated: {cpu_s_per_row * 1000:.2f} ms CPU per row; {settings.rows} rows")
    info = sandbox.up(settings.name, nodes=len(settings.cpu.split(",")), cpu=settings.cpu)
    results = []
    try:
        cluster = load_cluster(info.cluster_file)
        cores = [n.cpu for n in info.nodes]
        ideal = ideal_makespan(settings.rows * cpu_s_per_row, cores, settings.hog_after_s, settings.hogs)
        rates = measure_capacity(info.nodes, settings.work)
        measured = ideal_makespan(float(settings.rows), rates, settings.hog_after_s, settings.hogs)
        say(f"ideal {ideal:.1f} s from the quotas; {measured:.1f} s from the rates the nodes deliver "
            f"({', '.join(f'{r:.1f}' for r in rates)} rows/s)")
        for mode in modes:
            say(f"{mode}: running")
            results.append(_one(mode, settings, cluster, info, data, out / mode, ideal, measured))
            say(f"{mode}: {results[-1]['makespan_s']:.1f} s ({results[-1]['vs_ideal']:.2f}x ideal, "
                f"{results[-1]['vs_measured']:.2f}x measured capacity)")
    finally:
        sandbox.down(settings.name)
    doc = {"settings": asdict(settings), "cpu_s_per_row": cpu_s_per_row, "ideal_makespan_s": round(ideal, 2),
           "node_rows_per_s": [round(r, 2) for r in rates], "measured_makespan_s": round(measured, 2),
           "rows": results, "results_dir": str(out), "command": " ".join(sys.argv)}
    (out / "results.json").write_text(json.dumps(doc, indent=1))
    (out / "table.md").write_text(markdown_table(results))
    return doc


def _one(mode: str, s: BatchBenchSettings, cluster, info, data: Path, out: Path, ideal: float,
         measured: float) -> dict[str, Any]:
    from vpscluster.jobs.run import BatchSpec, run_batch

    n = len(info.nodes)
    spec = BatchSpec(fn="vpscluster.bench.batch:burn", input=str(data), output=str(out),
                     partition_rows=-(-s.rows // n) if mode == "static" else s.partition_rows,
                     workers_per_node=1 if mode == "static" else None, max_load=s.max_load,
                     admission=mode.startswith("vpscluster"), speculation=mode.startswith("vpscluster"),
                     depth=1 if mode == "vpscluster-depth1" else 2,
                     placement="dask" if mode == "dask" else "vpscluster", retries=0)
    started = {}
    hog = _Hog(info.nodes[0], s.hogs)
    timer = threading.Timer(s.hog_after_s, hog.start)

    def on_event(ev: dict) -> None:
        if ev["event"] == "workers" and "t" not in started:  # the hog's clock starts with the work
            started["t"] = time.monotonic()
            timer.start()
        elif ev["event"] == "done":  # the makespan ends with the last result, before teardown
            started["end"] = time.monotonic()

    try:
        result = run_batch(spec, cluster, on_event=on_event)
    finally:
        timer.cancel()
        hog.stop()
    makespan = started.get("end", time.monotonic()) - started.get("t", time.monotonic())
    busy = {node: v["seconds"] for node, v in result.per_node.items()}
    workers = {node: v["workers"] for node, v in result.nodes.items()}
    return {
        "mode": mode, "ok": result.ok, "error": result.error, "makespan_s": round(makespan, 2),
        "vs_ideal": round(makespan / ideal, 3), "vs_measured": round(makespan / measured, 3), "rows_per_s": round(s.rows / makespan, 1),
        "idle_share": {node: round(max(0.0, 1 - busy.get(node, 0) / makespan / max(1, workers.get(node, 1))), 3)
                       for node in workers},
        "duplicated_rows_share": round(result.duplicated_rows / s.rows, 4),
        "partitions_per_node": {node: v["partitions"] for node, v in result.per_node.items()},
    }


class _Hog:
    """Busy processes inside one sandbox node's network namespace and CPU cgroup."""

    def __init__(self, node, count: int) -> None:
        self.node, self.count, self.procs = node, count, []

    def start(self) -> None:
        for _ in range(self.count):
            self.procs.append(subprocess.Popen(
                enter_argv(self.node.cgroup, self.node.namespace, [sys.executable, "-c", "while True: pass"]),
                stdin=subprocess.DEVNULL))

    def stop(self) -> None:
        for p in self.procs:
            p.kill()
            p.wait(timeout=10)


COLUMNS = [("mode", "mode", "{}"), ("makespan_s", "makespan s", "{:.1f}"), ("vs_ideal", "x ideal", "{:.2f}"),
           ("vs_measured", "x measured capacity", "{:.2f}"),
           ("rows_per_s", "rows/s", "{:.1f}"), ("duplicated_rows_share", "duplicated", "{:.1%}"),
           ("idle_share", "idle share per node", "{}"), ("partitions_per_node", "partitions per node", "{}")]


def cell(row: dict, key: str, fmt: str) -> str:
    v = row.get(key)
    if isinstance(v, dict):
        return " ".join(f"{k}:{x:.0%}" if isinstance(x, float) else f"{k}:{x}" for k, x in v.items())
    return "-" if v is None else fmt.format(v)


def markdown_table(rows: list[dict]) -> str:
    return table.markdown(rows, COLUMNS, cell) + "\n"
