"""Hand partitions to Dask workers: load-aware admission, speculation, retries, exactly-once output.

Dask runs the tasks (transfer, execution, rescheduling the tasks of a lost worker); this loop
decides *when* and *where* a partition enters Dask. Each worker (one per usable core) holds at
most one of our partitions at a time, so nothing queues on a node that turns busy: a partition
is submitted only to an idle worker of an admitted node, pinned to it with a loose restriction
(`allow_other_workers=True`: if that worker dies, Dask runs the task elsewhere).

- Admission: every `load_interval_s` each node reports the CPU share taken by processes that
  are not this job's (`load.sample_load`). Above `max_load` the node gets no new partitions
  until it falls below again. If every node is above, the least loaded one keeps going, so a
  job on a busy machine is slowed, never stalled.
- Speculation: once nothing is left to hand out, a partition running much longer than its node
  usually needs per row (median of its finished partitions; the cluster's median before it has
  any) gets a backup copy on an idle worker of another admitted node (of its own node when there
  is no other). The first result wins, the other copy is cancelled (a copy already running
  finishes in its worker thread, as Dask cannot stop a running Python function; its result is
  dropped).
- Retries: a failed attempt (an error raised by the function, a worker lost more often than
  Dask allows) goes back to the front of the queue, up to `retries` times; then the job stops
  with the last error, one line naming the partition.
"""

from __future__ import annotations

import asyncio
import collections
import os
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

from vpscluster.jobs.inputs import Partition
from vpscluster.jobs.outputs import AssignmentLog, encode_rows, part_name, write_atomic


NO_WORKERS_LIMIT_S = 60.0


@dataclass
class Attempt:
    key: str
    part: Partition
    rows: list[dict]
    number: int  # 1 for the first run of a partition, 2... for retries
    worker: str  # the address it was submitted to
    node: str
    backup: bool
    started: float
    future: object = None
    waiter: asyncio.Task | None = None


@dataclass
class DispatchOptions:
    fn: str
    code_dirs: dict[str, str | None]
    params: dict[str, dict[str, str]]  # node -> the function's keyword arguments there
    output: str
    output_format: str = "jsonl"
    on_error: str = "fail"
    retries: int = 2
    gpu: bool = False
    max_load: float = 0.8
    admission: bool = True
    speculation: bool = True
    speculation_factor: float = 2.5
    load_interval_s: float = 1.0
    job_id: str = ""
    # "vpscluster": the loop above. "dask": every partition submitted at once, placed by Dask's
    # scheduler alone (its queuing and work stealing; no admission, no speculation): the
    # benchmark's plain-Dask baseline.
    placement: str = "vpscluster"


@dataclass
class Stats:
    done: int = 0
    rows_in: int = 0
    rows_out: int = 0
    rows_skipped: list = field(default_factory=list)
    retries: int = 0
    backups: int = 0
    backups_won: int = 0
    duplicated_rows: int = 0
    workers_lost: list = field(default_factory=list)
    per_node: dict = field(default_factory=dict)
    partitions: list = field(default_factory=list)
    error: str | None = None


class Dispatcher:
    def __init__(self, client, dask, opts: DispatchOptions, source: Iterator[tuple[Partition, list[dict]]],
                 on_event: Callable[[dict], None], stop: asyncio.Event) -> None:
        self.client, self.dask, self.opts, self.on_event, self.stop = client, dask, opts, on_event, stop
        self.source = source
        self.source_done = False
        self.pending: collections.deque[tuple[Partition, list[dict], int]] = collections.deque()
        self.running: dict[str, Attempt] = {}
        self.done: set[int] = set()
        self.workers: dict[str, dict] = {}  # address -> {"name", "node", "gpu"}
        self.admitted: dict[str, bool] = {n: True for n in dask.nodes}
        self.load: dict[str, dict] = {}
        self.seconds_per_row: dict[str, list[float]] = collections.defaultdict(list)
        self.stats = Stats(per_node={n: {"partitions": 0, "rows": 0, "seconds": 0.0} for n in dask.nodes})
        self.log = AssignmentLog(opts.output)
        self._next_sample = 0.0
        self._no_workers_since: float | None = None

    # --- the loop -------------------------------------------------------------------------

    async def run(self) -> Stats:
        try:
            while not self.stop.is_set() and self.stats.error is None:
                if time.monotonic() >= self._next_sample:
                    await self._sample()
                self._fill()
                if self.opts.speculation and self.opts.placement != "dask" and self.source_done and not self.pending:
                    self._speculate()
                if self.source_done and not self.pending and not self.running:
                    break
                waiters = [a.waiter for a in self.running.values()]
                timeout = max(0.05, min(self._next_sample - time.monotonic(), 0.5))
                if not waiters:
                    await asyncio.sleep(timeout)
                    continue
                finished, _ = await asyncio.wait(waiters, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
                for w in finished:
                    self._finish(*w.result())
        finally:
            await self._cancel(list(self.running.values()))
            self.log.close()
        return self.stats

    async def _sample(self) -> None:
        from vpscluster.jobs.load import sample_load

        self._next_sample = time.monotonic() + self.opts.load_interval_s
        try:
            ident = await asyncio.wait_for(self.client.scheduler.identity(), 10)
        except (asyncio.TimeoutError, OSError):
            return
        alive = {}
        for addr, w in ident.get("workers", {}).items():
            name = str(w.get("name", addr))
            alive[addr] = {"name": name, "node": self.dask.node_of(name), "gpu": bool((w.get("resources") or {}).get("GPU"))}
        for addr in set(self.workers) - set(alive):
            self.stats.workers_lost.append(self.workers[addr]["name"])
            self._event("worker_lost", worker=self.workers[addr]["name"], node=self.workers[addr]["node"])
        self.workers = alive
        if alive:
            self._no_workers_since = None
        else:  # Dask would wait for a worker forever
            self._no_workers_since = self._no_workers_since or time.monotonic()
            if time.monotonic() - self._no_workers_since > NO_WORKERS_LIMIT_S:
                self.stats.error = (f"every Dask worker has been gone for {NO_WORKERS_LIMIT_S:.0f} s "
                                    f"({', '.join(self.stats.workers_lost) or 'none ever joined'}); "
                                    "see the node logs; re-run to finish the remaining partitions")
        if not self.opts.admission or not alive:
            return
        one_per_node = {}
        for addr, w in alive.items():
            one_per_node.setdefault(w["node"], addr)
        try:
            loads = await asyncio.wait_for(self.client.run(sample_load, self.opts.job_id, workers=list(one_per_node.values()),
                                                           on_error="return"), 10)
        except (asyncio.TimeoutError, OSError):
            return
        for node, addr in one_per_node.items():
            if isinstance(loads.get(addr), dict):
                self.load[node] = loads[addr]
        self._admit()

    def _admit(self) -> None:
        foreign = {n: (self.load.get(n) or {}).get("foreign") for n in self.admitted}
        want = {n: f is None or f <= self.opts.max_load for n, f in foreign.items()}
        if not any(want.values()):  # everyone is busy: the least busy keeps working
            known = {n: f for n, f in foreign.items() if f is not None}
            want[min(known, key=known.get)] = True
        for node, ok in want.items():
            if ok != self.admitted[node]:
                self.admitted[node] = ok
                self._event("admission", node=node, admitted=ok, foreign_load=foreign[node])
                self.log.write({"event": "admission", "node": node, "admitted": ok, "foreign_load": foreign[node],
                                "t": time.time()})

    # --- handing out ------------------------------------------------------------------------

    def _idle_workers(self, exclude_node: str | None = None) -> list[str]:
        busy = collections.Counter(a.worker for a in self.running.values())
        out = [addr for addr, w in self.workers.items()
               if self.admitted.get(w["node"], False) and busy[addr] == 0 and w["node"] != exclude_node
               and (w["gpu"] or not self.opts.gpu)]
        # Least-loaded nodes first, so an idle fast node is preferred for backups and new work.
        return sorted(out, key=lambda a: ((self.load.get(self.workers[a]["node"]) or {}).get("foreign") or 0.0, a))

    def _next(self) -> tuple[Partition, list[dict], int] | None:
        if self.pending:
            return self.pending.popleft()
        if self.source_done:
            return None
        item = next(self.source, None)
        if item is None:
            self.source_done = True
            return None
        return item[0], item[1], 1

    def _fill(self) -> None:
        if self.opts.placement == "dask":
            while self.workers and (item := self._next()) is not None:
                self._submit(*item, worker=None, backup=False)
            return
        for addr in self._idle_workers():
            item = self._next()
            if item is None:
                return
            self._submit(*item, worker=addr, backup=False)

    def _speculate(self) -> None:
        now = time.monotonic()
        for a in sorted(self.running.values(), key=lambda a: a.started):
            if a.backup or sum(1 for b in self.running.values() if b.part.index == a.part.index) > 1:
                continue
            spr = self.seconds_per_row.get(a.node) or [x for v in self.seconds_per_row.values() for x in v]
            if len(spr) < 2:
                continue
            expected = statistics.median(spr) * a.part.rows
            if now - a.started < self.opts.speculation_factor * expected + 1.0:
                continue
            # Another node first (this one may be the slow one); on a one-node cluster, another worker.
            idle = self._idle_workers(exclude_node=a.node) or [w for w in self._idle_workers() if w != a.worker]
            if not idle:
                return
            self.stats.backups += 1
            self.stats.duplicated_rows += a.part.rows
            self._submit(a.part, a.rows, a.number, worker=idle[0], backup=True)

    def _submit(self, part: Partition, rows: list[dict], number: int, worker: str | None, backup: bool) -> None:
        from vpscluster.jobs.task import run_partition

        # worker None: Dask places it (the head's code dir and parameters stand for every node's).
        w = self.workers[worker] if worker else {"name": None, "node": self.dask.head}
        key = f"vpsc-{self.opts.job_id[:8]}-p{part.index}-a{number}" + ("-backup" if backup else "")
        fut = self.client.submit(run_partition, self.opts.fn, self.opts.code_dirs.get(w["node"]), rows, part.to_dict(),
                                 self.opts.on_error, self.opts.params.get(w["node"], {}), key=key,
                                 workers=[worker] if worker else None, allow_other_workers=bool(worker), pure=False,
                                 resources={"GPU": 1} if self.opts.gpu else None)
        a = Attempt(key, part, rows, number, worker or "", w["node"], backup, time.monotonic(), fut)
        a.waiter = asyncio.ensure_future(_outcome(key, fut))
        self.running[key] = a
        self.log.write({"event": "assign", "partition": part.index, "attempt": number, "backup": backup,
                        "worker": w["name"], "node": w["node"], "t": time.time()})
        self._event("assign", partition=part.index, node=w["node"], worker=w["name"], backup=backup, attempt=number)

    # --- results ---------------------------------------------------------------------------

    def _finish(self, key: str, ok: bool, value) -> None:
        a = self.running.pop(key, None)
        if a is None:
            return
        idx = a.part.index
        siblings = [b for b in self.running.values() if b.part.index == idx]
        if idx in self.done:
            return
        if not ok:
            if siblings:  # another copy may still succeed
                return
            why = _why(value)
            if a.number > self.opts.retries:
                self.stats.error = (f"partition {idx} ({a.part.where()}) failed after {a.number} attempts: {why}"
                                    if not why.startswith(f"partition {idx} ") else f"{why} (after {a.number} attempts)")
                return
            self.stats.retries += 1
            self.log.write({"event": "retry", "partition": idx, "attempt": a.number, "error": why, "t": time.time()})
            self._event("retry", partition=idx, attempt=a.number, error=why)
            self.pending.appendleft((a.part, a.rows, a.number + 1))
            return
        node = self.dask.node_of(value["worker"])
        path = os.path.join(self.opts.output, part_name(idx, self.opts.output_format))
        try:
            write_atomic(path, encode_rows(value["rows"], self.opts.output_format))
        except OSError as e:  # disk full, folder removed: stop; the finished partitions stay
            self.stats.error = f"cannot write {path}: {e.strerror or e}; free space or fix the folder, then re-run"
            return
        except Exception as e:  # rows Parquet cannot hold (mixed types in a column, ...)
            self.stats.error = (f"partition {idx}: the function's rows cannot be written as {self.opts.output_format}: "
                                f"{_why(e)}")
            return
        self.done.add(idx)
        if a.backup:
            self.stats.backups_won += 1
        for b in siblings:
            self.running.pop(b.key, None)
            asyncio.ensure_future(self._cancel([b]))
        s = self.stats
        s.done += 1
        s.rows_in += a.part.rows
        s.rows_out += len(value["rows"])
        s.rows_skipped += [{"partition": idx, **r} for r in value["skipped"]]
        per = s.per_node.setdefault(node, {"partitions": 0, "rows": 0, "seconds": 0.0})
        per["partitions"] += 1
        per["rows"] += a.part.rows
        per["seconds"] = round(per["seconds"] + value["seconds"], 3)
        self.seconds_per_row[node].append(value["seconds"] / max(1, a.part.rows))
        record = {"index": idx, "file": os.path.basename(path), "rows_in": a.part.rows, "rows_out": len(value["rows"]),
                  "node": node, "worker": value["worker"], "seconds": round(value["seconds"], 4),
                  "attempt": a.number, "backup": a.backup, "skipped_rows": len(value["skipped"])}
        s.partitions.append(record)
        self.log.write({"event": "done", "partition": idx, "worker": value["worker"], "node": node, "t": time.time()})
        self._event("done", **record)

    async def _cancel(self, attempts: list[Attempt]) -> None:
        for a in attempts:
            if a.waiter is not None:
                a.waiter.cancel()
        futures = [a.future for a in attempts if a.future is not None]
        if futures:
            try:
                await asyncio.wait_for(self.client.cancel(futures), 10)
            except Exception:  # the cluster is going away anyway; teardown verifies
                pass

    def _event(self, kind: str, **fields) -> None:
        self.on_event({"event": kind, **fields})


async def _outcome(key: str, fut) -> tuple[str, bool, object]:
    try:
        return key, True, await fut
    except asyncio.CancelledError:
        raise
    except BaseException as e:  # the user's error, KilledWorker, a lost connection
        return key, False, e


def _why(e: BaseException) -> str:
    from vpscluster.errors import UserError
    from vpscluster.jobs.task import RowError

    if isinstance(e, (RowError, UserError)):
        return str(e)
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__
