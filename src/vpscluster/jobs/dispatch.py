"""Hand partitions to Dask workers: load-aware admission, speculation, retries, exactly-once output.

Dask runs the tasks (transfer, execution, rescheduling the tasks of a lost worker); this loop
decides *when* and *where* a partition enters Dask. Each worker (one per usable core) of an
admitted node holds at most `depth` (2) of our partitions: the one it runs and the next, so it
starts the next the moment it finishes instead of waiting a round trip to this loop for it. A
partition is pinned to its worker with a loose restriction (`allow_other_workers=True`: if that
worker dies, Dask runs the task elsewhere). A queued (not yet started) partition moves to
another worker when its node is refused (admission), and, once nothing is left to hand out, to
an idle worker that would finish it sooner than its own worker (behind a straggler, on a slow
node). A worker whose running partition is overdue gets nothing queued behind it.

- Admission: every `load_interval_s` each node reports the CPU share taken by processes that
  are not this job's (`load.sample_load`; with `busy` — the monitoring's Prometheus — the node's
  busy share comes from there, less this job's share from the sample). Above `max_load` the
  node gets no new partitions (its queued ones move elsewhere) until it falls below
  `max_load - readmit_margin` (hysteresis: a load hovering at the threshold does not flap). If
  every node is above, the least loaded one keeps going, so a job on a busy machine is slowed,
  never stalled.
- Speculation: once nothing is left to hand out, a partition running much longer than its node
  usually needs per row (median of its last finished partitions; the cluster's median before it
  has any) gets a backup copy on an idle worker of another admitted node (of its own node when
  there is no other). So does, within `max_duplicate_share` of the rows, a partition that an
  idle worker would finish in less than half the time its own node still needs (the slowest or
  a newly loaded node holding the end of the job). The first result wins, the other copy is
  cancelled (a copy already running finishes in its worker thread, as Dask cannot stop a running
  Python function; its result is dropped).
- Retries: a failed attempt (an error raised by the function, a worker lost more often than
  Dask allows, `task_timeout_s` exceeded) goes back to the front of the queue, preferably for a
  node that has not failed it yet, up to `retries` times; then the job stops with the last
  error, one line naming the partition. A partition over `task_memory_mb` is not retried (it
  would need as much again anywhere): the job stops with one line saying so.
- Load samples are taken in the background (the loop keeps handing out partitions meanwhile).
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
    started: float  # when it started running (as far as this loop knows): submitted, or its predecessor done
    seq: int = 0  # submission order (a worker runs its partitions in this order)
    queued: bool = False  # submitted behind another partition on its worker, not started yet
    avoid: frozenset = frozenset()  # nodes whose attempts at this partition failed
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
    # A withdrawn node comes back only below max_load - readmit_margin: a load that hovers at the
    # threshold must not withdraw and re-admit the node every sample (each costs a moved partition).
    readmit_margin: float = 0.1
    admission: bool = True
    speculation: bool = True
    speculation_factor: float = 2.5
    max_duplicate_share: float = 0.05  # of the rows: backups for partitions merely faster elsewhere
    load_interval_s: float = 1.0
    job_id: str = ""
    depth: int = 2  # partitions in flight per worker: the running one and the next
    task_timeout_s: float | None = None  # a partition running longer fails (and is retried)
    task_memory_mb: float | None = None  # a partition using more memory fails (not retried)
    # "vpscluster": the loop above. "dask": every partition submitted at once, placed by Dask's
    # scheduler alone (its queuing and work stealing; no admission, no speculation): the
    # benchmark's plain-Dask baseline.
    placement: str = "vpscluster"
    # node -> busy share of its CPU from the monitoring (None: no monitor; use the direct samples)
    busy: Callable[[], dict[str, float] | None] | None = None


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
    moved: int = 0  # queued partitions handed to another worker before they started
    load_sources: set = field(default_factory=set)  # "prometheus", "proc"
    workers_lost: list = field(default_factory=list)
    per_node: dict = field(default_factory=dict)
    partitions: list = field(default_factory=list)
    error: str | None = None


def admission(foreign: dict[str, float | None], admitted: dict[str, bool], max_load: float,
              margin: float) -> dict[str, bool]:
    """Which nodes take new partitions, from each node's foreign load (None: not known yet).

    An admitted node stays while its foreign load is at most `max_load`; a withdrawn one returns
    once it is at most `max_load - margin` (hysteresis). When every node would be out, the least
    busy one keeps working, so a job on a busy cluster is slowed, never stopped."""
    want = {n: f is None or f <= (max_load if admitted.get(n, True) else max_load - margin)
            for n, f in foreign.items()}
    if want and not any(want.values()):
        known = {n: f for n, f in foreign.items() if f is not None}
        want[min(known, key=known.get)] = True
    return want


class Dispatcher:
    def __init__(self, client, dask, opts: DispatchOptions, source: Iterator[tuple[Partition, list[dict]]],
                 on_event: Callable[[dict], None], stop: asyncio.Event) -> None:
        self.client, self.dask, self.opts, self.on_event, self.stop = client, dask, opts, on_event, stop
        self.source = source
        self.source_done = False
        # (partition, rows, attempt number, nodes that failed it)
        self.pending: collections.deque[tuple[Partition, list[dict], int, frozenset]] = collections.deque()
        self.running: dict[str, Attempt] = {}
        self.done: set[int] = set()
        self.workers: dict[str, dict] = {}  # address -> {"name", "node", "gpu"}
        self.admitted: dict[str, bool] = {n: True for n in dask.nodes}
        self.load: dict[str, dict] = {}
        self.seconds_per_row: dict[str, list[float]] = collections.defaultdict(list)
        self.stats = Stats(per_node={n: {"partitions": 0, "rows": 0, "seconds": 0.0} for n in dask.nodes})
        self.log = AssignmentLog(opts.output)
        self._next_sample = 0.0
        self._sampler: asyncio.Task | None = None
        self._seq = 0
        self._no_workers_since: float | None = None

    # --- the loop -------------------------------------------------------------------------

    async def run(self) -> Stats:
        try:
            while not self.stop.is_set() and self.stats.error is None:
                if self._sampler is None and time.monotonic() >= self._next_sample:
                    self._next_sample = time.monotonic() + self.opts.load_interval_s
                    self._sampler = asyncio.ensure_future(self._sample())
                if self._sampler is not None and (self._sampler.done() or not self.workers):
                    await self._sampler  # the first sample: nothing can be handed out before it
                    self._sampler = None
                self._promote()
                if self.opts.placement != "dask":
                    self._rebalance()
                self._fill()
                if self.opts.speculation and self.opts.placement != "dask" and self.source_done and not self.pending:
                    self._speculate()
                if self.source_done and not self.pending and not self.running:
                    break
                waiters = [a.waiter for a in self.running.values()]
                if self._sampler is not None:
                    waiters.append(self._sampler)
                timeout = max(0.05, min(self._next_sample - time.monotonic(), 0.5))
                if not waiters:
                    await asyncio.sleep(timeout)
                    continue
                finished, _ = await asyncio.wait(waiters, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
                for w in finished:
                    if w is self._sampler:
                        continue
                    if w.cancelled():  # withdrawn by us (then no longer in `running`), or else a failed attempt
                        a = next((a for a in self.running.values() if a.waiter is w), None)
                        if a is not None:
                            self._finish(a.key, False, asyncio.CancelledError("the attempt was cancelled"))
                        continue
                    self._finish(*w.result())
        finally:
            if self._sampler is not None:
                self._sampler.cancel()
            await self._cancel(list(self.running.values()))
            self.log.close()
        return self.stats

    async def _sample(self) -> None:
        from vpscluster.jobs.load import sample_load

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
        busy = None
        if self.opts.busy is not None:
            try:
                busy = await asyncio.wait_for(asyncio.to_thread(self.opts.busy), 5)
            except asyncio.TimeoutError:
                busy = None
        for node, addr in one_per_node.items():
            if isinstance(loads.get(addr), dict):
                self.load[node] = {**loads[addr], "source": "proc"}
                ours = loads[addr].get("ours")
                if busy and node in busy and ours is not None:
                    self.load[node].update(foreign=round(max(0.0, busy[node] - ours), 3), source="prometheus")
                if self.load[node].get("foreign") is not None:  # the first sample has nothing to compare with
                    self.stats.load_sources.add(self.load[node]["source"])
        self._admit()

    def _admit(self) -> None:
        foreign = {n: (self.load.get(n) or {}).get("foreign") for n in self.admitted}
        want = admission(foreign, self.admitted, self.opts.max_load, self.opts.readmit_margin)
        for node, ok in want.items():
            if ok != self.admitted[node]:
                self.admitted[node] = ok
                source = (self.load.get(node) or {}).get("source")
                self._event("admission", node=node, admitted=ok, foreign_load=foreign[node], source=source)
                self.log.write({"event": "admission", "node": node, "admitted": ok, "foreign_load": foreign[node],
                                "source": source, "t": time.time()})

    # --- handing out ------------------------------------------------------------------------

    def _usable(self, addr: str) -> bool:
        w = self.workers[addr]
        return self.admitted.get(w["node"], False) and (w["gpu"] or not self.opts.gpu)

    def _by_worker(self) -> dict[str, list[Attempt]]:
        """Each worker's attempts in the order it runs them (the first is running)."""
        out: dict[str, list[Attempt]] = collections.defaultdict(list)
        for a in sorted(self.running.values(), key=lambda a: a.seq):
            out[a.worker].append(a)
        return out

    def _load_order(self, addrs) -> list[str]:
        # Least-loaded nodes first, so an idle fast node is preferred for backups and new work.
        return sorted(addrs, key=lambda a: ((self.load.get(self.workers[a]["node"]) or {}).get("foreign") or 0.0, a))

    def _idle_workers(self, exclude_node: str | None = None) -> list[str]:
        busy = collections.Counter(a.worker for a in self.running.values())
        return self._load_order(addr for addr, w in self.workers.items()
                                if self._usable(addr) and busy[addr] == 0 and w["node"] != exclude_node)

    def _spr(self, node: str) -> float | None:
        """Seconds per row on a node: the median of its last partitions (nodes change speed), else
        the cluster's; None before any."""
        spr = self.seconds_per_row.get(node, [])[-5:] or [x for v in self.seconds_per_row.values() for x in v[-5:]]
        return statistics.median(spr) if len(spr) >= 2 else None

    def _overdue(self, a: Attempt, now: float) -> bool:
        spr = self._spr(a.node)
        return spr is not None and now - a.started >= self.opts.speculation_factor * spr * a.part.rows + 1.0

    def _promote(self) -> None:
        """A queued attempt whose predecessor on its worker is gone has started running."""
        now = time.monotonic()
        for attempts in self._by_worker().values():
            head = attempts[0]
            if head.queued:
                head.queued, head.started = False, now

    def _next(self, node: str | None = None) -> tuple[Partition, list[dict], int, frozenset] | None:
        """The next partition for a worker on `node`: a retry first (one that failed on this node
        only when no other admitted node could take it), else the next one read."""
        others = {w["node"] for addr, w in self.workers.items() if self._usable(addr)} - {node}
        for i, item in enumerate(self.pending):
            if node is None or node not in item[3] or others <= item[3]:
                del self.pending[i]
                return item
        if self.source_done:
            return None
        item = next(self.source, None)
        if item is None:
            self.source_done = True
            return None
        return item[0], item[1], 1, frozenset()

    def _fill(self) -> None:
        if self.opts.placement == "dask":
            while self.workers and (item := self._next()) is not None:
                self._submit(*item, worker=None, backup=False)
            return
        now = time.monotonic()
        by_worker = self._by_worker()
        # Idle workers first, then a next partition queued behind each running one.
        for depth in range(max(1, self.opts.depth)):
            ready = [addr for addr in self.workers if self._usable(addr) and len(by_worker.get(addr, [])) == depth
                     and not (depth and self._overdue(by_worker[addr][0], now))]
            for addr in self._load_order(ready):
                item = self._next(self.workers[addr]["node"])
                if item is None:
                    if self.source_done and not self.pending:
                        return
                    continue
                by_worker[addr] = by_worker.get(addr, []) + [self._submit(*item, worker=addr, backup=False)]

    def _rebalance(self) -> None:
        """Move queued attempts that have not started: off refused nodes, and at the end of the
        job to an idle worker that would finish them sooner than the worker they wait on."""
        now = time.monotonic()
        by_worker = self._by_worker()
        back = [a for a in self.running.values() if a.queued and not a.backup
                and not self.admitted.get(a.node, True) and a.worker in self.workers]
        for a in sorted(back, key=lambda a: a.seq, reverse=True):
            self._withdraw(a, f"node {a.node} refused (load)")
            self.pending.appendleft((a.part, a.rows, a.number, a.avoid))
        if back or not self.source_done or self.pending:
            return
        for idle in self._idle_workers():
            best, gain = None, 0.0
            spr_idle = self._spr(self.workers[idle]["node"])
            if spr_idle is None:
                return
            for attempts in by_worker.values():
                if len(attempts) < 2 or attempts[0].queued:
                    continue
                head, spr = attempts[0], self._spr(attempts[0].node)
                elapsed = now - head.started
                expected_head = spr * head.part.rows
                # A head past its expected time is assumed to need as long again (a straggler).
                wait = expected_head - elapsed if elapsed < expected_head else elapsed
                for a in attempts[1:]:
                    if a.backup:
                        continue
                    stay = wait + spr * a.part.rows
                    move = spr_idle * a.part.rows
                    if move < 0.8 * stay and stay - move > gain:
                        best, gain = a, stay - move
                    wait += spr * a.part.rows
            if best is None:
                return
            self._withdraw(best, "an idle worker finishes it sooner")
            by_worker[best.worker].remove(best)
            self._submit(best.part, best.rows, best.number, worker=idle, backup=False, avoid=best.avoid)
            self.stats.moved += 1

    def _withdraw(self, a: Attempt, why: str) -> None:
        self.running.pop(a.key, None)
        asyncio.ensure_future(self._cancel([a]))
        self.log.write({"event": "withdraw", "partition": a.part.index, "attempt": a.number, "node": a.node,
                        "why": why, "t": time.time()})
        self._event("withdraw", partition=a.part.index, node=a.node, why=why)

    def _speculate(self) -> None:
        """Backups once nothing is left to hand out: for a straggler (overdue for its node), and,
        within `max_duplicate_share` of the rows, for a partition an idle worker would finish
        well before its own slow (or slowed) node does."""
        now = time.monotonic()
        rows_known = self.stats.rows_in + sum(a.part.rows for a in self.running.values() if not a.backup)
        for a in sorted(self.running.values(), key=lambda a: a.started):
            if a.backup or a.queued or sum(1 for b in self.running.values() if b.part.index == a.part.index) > 1:
                continue
            # Another node first (this one may be the slow one); on a one-node cluster, another worker.
            idle = self._idle_workers(exclude_node=a.node) or [w for w in self._idle_workers() if w != a.worker]
            if not idle:
                return
            if not self._overdue(a, now):
                spr = self._spr(a.node)
                fastest = min(idle, key=lambda w: self._spr(self.workers[w]["node"]) or float("inf"))
                spr_idle = self._spr(self.workers[fastest]["node"])
                if spr is None or spr_idle is None:
                    continue
                left, fresh = spr * a.part.rows - (now - a.started), spr_idle * a.part.rows
                budget = self.opts.max_duplicate_share * rows_known - self.stats.duplicated_rows
                if not (left > 2 * fresh and left - fresh > 1.0 and a.part.rows <= budget):
                    continue
                idle = [fastest]
            self.stats.backups += 1
            self.stats.duplicated_rows += a.part.rows
            self._submit(a.part, a.rows, a.number, worker=idle[0], backup=True, avoid=a.avoid)

    def _submit(self, part: Partition, rows: list[dict], number: int, avoid: frozenset = frozenset(), *,
                worker: str | None, backup: bool) -> Attempt:
        from vpscluster.jobs.task import run_partition

        # worker None: Dask places it (the head's code dir and parameters stand for every node's).
        w = self.workers[worker] if worker else {"name": None, "node": self.dask.head}
        self._seq += 1
        key = f"vpsc-{self.opts.job_id[:8]}-p{part.index}-a{number}-s{self._seq}" + ("-backup" if backup else "")
        limits = {"timeout_s": self.opts.task_timeout_s, "memory_mb": self.opts.task_memory_mb}
        fut = self.client.submit(run_partition, self.opts.fn, self.opts.code_dirs.get(w["node"]), rows, part.to_dict(),
                                 self.opts.on_error, self.opts.params.get(w["node"], {}),
                                 limits if any(limits.values()) else None, key=key,
                                 workers=[worker] if worker else None, allow_other_workers=bool(worker), pure=False,
                                 resources={"GPU": 1} if self.opts.gpu else None)
        queued = bool(worker) and any(a.worker == worker for a in self.running.values())
        a = Attempt(key, part, rows, number, worker or "", w["node"], backup, time.monotonic(), self._seq, queued,
                    avoid, fut)
        a.waiter = asyncio.ensure_future(_outcome(key, fut))
        self.running[key] = a
        self.log.write({"event": "assign", "partition": part.index, "attempt": number, "backup": backup,
                        "worker": w["name"], "node": w["node"], "queued": queued, "t": time.time()})
        self._event("assign", partition=part.index, node=w["node"], worker=w["name"], backup=backup, attempt=number)
        return a

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
            from vpscluster.jobs.task import TaskMemoryError

            why = _why(value)
            failed_on = _failed_node(value) or a.node
            if isinstance(value, TaskMemoryError):  # as much again anywhere: no retry
                self.stats.error = why
                return
            if a.number > self.opts.retries:
                self.stats.error = (f"partition {idx} ({a.part.where()}) failed after {a.number} attempts: {why}"
                                    if not why.startswith(f"partition {idx} ") else f"{why} (after {a.number} attempts)")
                return
            self.stats.retries += 1
            self.log.write({"event": "retry", "partition": idx, "attempt": a.number, "node": failed_on, "error": why,
                            "t": time.time()})
            self._event("retry", partition=idx, attempt=a.number, error=why)
            self.pending.appendleft((a.part, a.rows, a.number + 1, a.avoid | {failed_on}))
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
    except asyncio.CancelledError as e:
        task = asyncio.current_task()
        if task is not None and task.cancelling():  # we withdrew this attempt ourselves
            raise
        # Dask cancelled the future (e.g. its client lost the scheduler for a moment under load):
        # a failed attempt like any other, retried; never a traceback.
        return key, False, e
    except BaseException as e:  # the user's error, KilledWorker, a lost connection
        return key, False, e


def _failed_node(e: BaseException) -> str | None:
    """The node an attempt failed on, when the error says (a task limit names its worker)."""
    worker = getattr(e, "worker", None)
    return worker.rsplit("/", 1)[0] if isinstance(worker, str) and worker else None


def _why(e: BaseException) -> str:
    from vpscluster.errors import UserError
    from vpscluster.jobs.task import RowError, TaskLimitError

    if isinstance(e, (RowError, UserError, TaskLimitError)):
        return str(e)
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__
