"""The recovery supervisor: one launch after another until the run ends, as `recovery.Policy` says.

`train` and `run` alike hand it a job factory — `make_job(cluster, resume)` builds the pipeline's
`Job` for a subset of the cluster's nodes, resuming from the newest checkpoint or not — and it
does the rest (launch/recovery.py has the rules):

- a failed launch is relaunched with `resume=True` on the nodes that teardown could still reach,
  while at least `policy.min_nodes` remain and `policy.max_restarts` is not spent;
- a relaunch refused before it trains (a node failing pre-flight or sync) is relaunched again
  without the nodes at fault (`recovery.at_fault`), counted as a restart;
- while a node is out, the launch stops at a checkpoint once it answers again
  (`recovery.wait_for_any`), what earlier launches left there is reaped, and the run relaunches
  with it (a rejoin: not counted).

Its state is plain attributes (the nodes of the current launch, the restarts, the launches'
rendezvous ids, the `recoveries` record for the report). It follows rank 0's events through
`watch` (`resume`, `checkpoint`, `stopping`, `step`), which every launch's `on_event` passes on.
`run()` returns the last launch's `LaunchResult`: ok, interrupted by a person, or failed with no
restart left; the caller turns that into its own outcome (a report, an error line).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Callable

from vpscluster.errors import Interrupted, RemoteError
from vpscluster.launch import recovery

MakeJob = Callable[[Any, bool], Any]  # (cluster of the nodes taking part, resume) -> pipeline Job
AfterLaunch = Callable[[Any, int], None]  # (LaunchResult, the step it resumed from) -> None


class RecoveryFailed(RemoteError):
    """A launch failed and fewer than `--min-nodes` nodes answer; the message says how to go on."""


def _quiet(_: str) -> None:
    """The null sink."""


class Supervisor:
    """Runs a job factory's launches with recovery (see the module docstring).

    `cluster`: the run's whole cluster; `policy`: `recovery.policy(...)`; `resume`: the first
    launch resumes (`--resume`); `continue_with`: the command a user runs to go on by hand when
    too few nodes answer (said in the error); `min_nodes_given`: `--min-nodes` came from the user;
    `retry_without_progress` False: a launch that failed while every node still answers and that
    saved no checkpoint is not relaunched (a script's own error would only come again: `run`),
    unless the quorum's lighthouse ended (no error of the script's: `run --quorum` relaunches)."""

    def __init__(self, cluster, policy: recovery.Policy, *, rejoin_poll_s: float, stop_grace_s: float | None,
                 resume: bool = False, continue_with: str, min_nodes_given: bool = False,
                 say: Callable[[str], None] = _quiet, failed: type[Exception] = RecoveryFailed,
                 retry_without_progress: bool = True) -> None:
        self.cluster = cluster
        self.policy = policy
        self.rejoin_poll_s = rejoin_poll_s
        self.stop_grace_s = stop_grace_s
        self.continue_with = continue_with
        self.min_nodes_given = min_nodes_given
        self.say = say
        self.failed = failed
        self.everyone = [n.name for n in cluster.nodes]
        self.current = list(self.everyone)  # the nodes of the next (or current) launch
        self.resume = resume  # the next launch resumes from the newest checkpoint
        self.restarts = 0  # relaunches after failures (rejoins are not counted)
        self.launch_ids: list[str] = []  # every launch's rendezvous id, for reaping a returning node
        self.recoveries: list[dict[str, Any]] = []  # the report's record of each relaunch
        self.last_step = 0  # rank 0's last step event
        self.resumed_from = 0  # the checkpoint step the current launch resumed from (0: the start)
        # The step of the checkpoint a stop saved: None: no stop seen; -1: stopping, none saved yet.
        self.stop_checkpoint: int | None = None
        self.retry_without_progress = retry_without_progress
        self.saved = False  # the current launch saved a checkpoint (rank 0's "checkpoint" event)
        self.step_seen: list[tuple[float, int]] = []  # (time.monotonic(), step) of rank 0's step events

    # ---- rank 0's events ------------------------------------------------------------------
    def watch(self, event: dict) -> None:
        """Follow one of rank 0's events (call it from the job's `on_event`)."""
        kind = event.get("event")
        if kind == "resume":
            self.resumed_from = int(event.get("step") or 0)
            last = self.recoveries[-1] if self.recoveries else None
            if last is not None and "resumed_from_step" not in last and "_at" in last:
                last["resumed_from_step"] = event.get("step")
                last["resumed_after_s"] = round(time.monotonic() - last["_at"], 1)  # the checkpoint loaded
        elif kind == "stopping":
            self.stop_checkpoint = -1
        elif kind == "checkpoint":
            self.saved = True
            self.last_step = max(self.last_step, int(event.get("step", 0)))  # a script's session has no step events
            if self.stop_checkpoint is not None:
                self.stop_checkpoint = int(event.get("step", -1))
        elif kind == "step":
            self.last_step = int(event.get("step", self.last_step))
            self.step_seen.append((time.monotonic(), self.last_step))
            last = self.recoveries[-1] if self.recoveries else None
            if last is not None and "training_again_after_s" not in last and "_at" in last:
                last["training_again_after_s"] = round(time.monotonic() - last["_at"], 1)
                last["training_again_at"] = round(time.time(), 2)

    @property
    def stopped_with_checkpoint(self) -> bool:
        """The last launch was stopped and saved a checkpoint (its report was written too)."""
        return self.stop_checkpoint is not None and self.stop_checkpoint >= 0

    def record(self) -> list[dict[str, Any]]:
        """The recoveries, for the report (without the supervisor's own timing marks)."""
        return [{k: v for k, v in r.items() if k != "_at"} for r in self.recoveries]

    # ---- the loop -------------------------------------------------------------------------
    def run(self, make_job: MakeJob, after_launch: AfterLaunch | None = None):
        """Launch until the run ends; the last launch's LaunchResult (see the module docstring).
        `after_launch` sees every launch that started (e.g. to merge its metrics)."""
        from vpscluster.launch.pipeline import launch

        while True:
            cluster = self.cluster if self.current == self.everyone else recovery.subset(self.cluster, self.current)
            out = [n for n in self.everyone if n not in self.current]
            job = make_job(cluster, self.resume)
            job.relaunch = bool(self.launch_ids)
            job.known_nodes = list(self.everyone)  # a node in the cluster file beyond these: added while it runs
            theirs = job.on_event
            job.on_event = lambda e, theirs=theirs: (self.watch(e), theirs(e) if theirs is not None else None)
            if job.fetch_when_interrupted is None:  # a stop that saved its checkpoint also wrote the report
                job.fetch_when_interrupted = lambda: self.stopped_with_checkpoint
            if out:  # while a node is out: look whether it answers again
                job.stop_when = lambda out=out: recovery.wait_for_any(self.cluster, out, self.rejoin_poll_s)
            self.stop_checkpoint = None
            self.resumed_from = 0
            self.saved = False
            try:
                result = launch(job)
            except Exception as e:  # refused before anything started: pre-flight, sync, prepare
                if isinstance(e, Interrupted) or not self.launch_ids:
                    raise  # the first launch is refused as any command is
                # A relaunch: a node failed its pre-flight or sync, or a returning one dropped again.
                gone = asyncio.run(recovery.at_fault(self.cluster, self.current, e))
                if not gone or self.restarts >= self.policy.max_restarts:
                    raise
                self._go_on_without(gone, f"the relaunch failed before training: {e}", gone[0], None)
                continue
            self.launch_ids.append(result.rdzv_id)
            first = len(self.recoveries)
            self._take_added(result)
            self._take_removed(result)
            if after_launch is not None:
                after_launch(result, self.resumed_from)
            if result.stopped_by_job:  # a node is back: it takes part from the checkpoint just saved
                self._take_back(out, result.ended_at)
                continue
            if result.lost_nodes and not result.interrupted:
                self._record_quorum_losses(result)
            self.recoveries[first:] = sorted(self.recoveries[first:], key=lambda r: r.get("detected_at", 0))
            if result.interrupted or result.ok or self.restarts >= self.policy.max_restarts:
                return result
            # A node that teardown could not reach is out (the watcher takes it back when it answers).
            unreached = [o.name for o in result.nodes if o.name in self.current and o.teardown_error]
            if not unreached and not self.saved and not self.retry_without_progress and not result.lighthouse_ended:
                self.say("not relaunched: every node still answers and the launch saved no checkpoint, "
                         "so a relaunch would only meet the same failure")
                return result
            self._go_on_without(unreached, str(result.error), result.failed_node, result.ended_at)

    def _go_on_without(self, gone: list[str], error: str, failed_node: str | None, ended_at: float | None) -> None:
        """Leave `gone` out, count a restart and relaunch on the rest; `failed` when too few remain."""
        live = [n for n in self.current if n not in gone]
        need = self.policy.min_nodes
        if len(live) < need:
            self.say(error)
            raise self.failed(
                f"the run failed and only {len(live)} of {len(self.everyone)} nodes answer ({', '.join(live) or 'none'}), "
                f"fewer than the {need} it needs (--min-nodes{'' if self.min_nodes_given else ', by default half'}); "
                f"the checkpoints stay on the nodes: continue with {self.continue_with}")
        self.restarts += 1
        out = [n for n in self.everyone if n not in live]
        self.say(f"{error}; relaunching on {len(live)} node{'s' if len(live) != 1 else ''} from the last checkpoint"
                 + (f" without {', '.join(out)}" if out else "") + f" (restart {self.restarts} of {self.policy.max_restarts})")
        # Timed from the moment the launcher saw the failure (a worker's time-out fired), so
        # teardown and the relaunch count, as a person waiting for training would count them.
        self.recoveries.append({"kind": "restart", "after_step": self.last_step, "error": error,
                                "failed_node": failed_node, "nodes": live, "out": out, **_seen(ended_at)})
        self.current, self.resume = live, True

    def _record_quorum_losses(self, result) -> None:
        """The quorum engine lost nodes and the others trained on without them, no relaunch: one
        `quorum` entry per node, timed from when the launcher saw it go to rank 0's next step, and
        one `quorum_rejoin` per node started again, timed from its answer to its first sync."""
        for node, at in zip(result.lost_nodes, result.lost_at):
            seen = _seen(at)
            at = seen.pop("_at")
            entry = {"kind": "quorum", "out": [node], "nodes": [n for n in self.current if n not in result.lost_nodes],
                     "after_step": max((s for t, s in self.step_seen if t <= at), default=0), **seen}
            again = next(((t, s) for t, s in self.step_seen if t > at), None)
            if again is not None:  # the survivors' next step announced after the loss was seen
                entry.update(training_again_after_s=round(again[0] - at, 1), training_again_at_step=again[1])
            self.recoveries.append(entry)
        for node, at, synced in zip(result.back_nodes, result.back_at, result.first_sync_at):  # healed from a peer
            seen = _seen(at)
            at = seen.pop("_at")
            entry = {"kind": "quorum_rejoin", "back": [node],
                     "after_step": max((s for t, s in self.step_seen if t <= at), default=0), **seen}
            if synced is not None:  # its first outer sync with the others, from when it answered again
                entry.update(first_sync_after_s=round(synced - at, 1))
            self.recoveries.append(entry)

    def _take_added(self, result) -> None:
        """Nodes added to the cluster file during the launch belong to the run from now on (a
        relaunch includes them); each is recorded as a `quorum_join`, timed from the file's change
        and from when the launcher saw it to its first outer sync."""
        import dataclasses

        for node in result.added:
            if node.name not in self.everyone:
                self.cluster = dataclasses.replace(self.cluster, nodes=(*self.cluster.nodes, node))
                self.everyone.append(node.name)
                self.current.append(node.name)
        for node, at, file_at, synced in zip(result.joined_nodes, result.joined_at, result.joined_file_at,
                                             result.join_sync_at):
            seen = _seen(at)
            at = seen.pop("_at")
            entry = {"kind": "quorum_join", "joined": [node], "joined_ok": node in [n.name for n in result.added],
                     "after_step": max((s for t, s in self.step_seen if t <= at), default=0), **seen}
            if synced is not None:  # its first outer sync with the others
                entry["first_sync_after_s"] = round(synced - at, 1)  # from when the launcher saw it
                if file_at is not None:  # from the cluster file's change (the user's edit)
                    entry["first_sync_after_added_s"] = round(synced - at + seen["detected_at"] - file_at, 1)
            self.recoveries.append(entry)

    def _take_removed(self, result) -> None:
        """Nodes removed from the cluster file during the launch leave the run (a relaunch leaves
        them out); each drained one is recorded as a `quorum_drain`, with the step after which it
        left and when the launcher saw it go."""
        import dataclasses

        gone = set(result.removed_nodes)
        if gone:
            self.cluster = dataclasses.replace(self.cluster, nodes=tuple(n for n in self.cluster.nodes if n.name not in gone))
            self.everyone = [n for n in self.everyone if n not in gone]
            self.current = [n for n in self.current if n not in gone]
        for node, at, step in zip(result.drained_nodes, result.drained_at, result.drained_step):
            seen = _seen(at)
            seen.pop("_at")
            self.recoveries.append({"kind": "quorum_drain", "drained": [node], "after_step": step,
                                    "reason": "removed from the cluster file", **seen})

    def _take_back(self, out: list[str], ended_at: float | None) -> None:
        back = asyncio.run(recovery.ready(self.cluster, out))
        left = asyncio.run(recovery.reap_left(self.cluster, back, self.launch_ids[:-1], self.stop_grace_s or 6.0))
        if left:
            self.say(f"could not clear what earlier launches left on a returning node ({'; '.join(left)}); it stays out")
            back = [n for n in back if not any(line.startswith(f"{n}: ") for line in left)]
        self.current = [n for n in self.everyone if n in self.current or n in back]
        saved = (f"the checkpoint of step {self.stop_checkpoint}" if self.stopped_with_checkpoint
                 else "the last checkpoint")  # stopped before it trained: nothing new to save
        self.say(f"{', '.join(back) or 'no node'} answer{'s' if len(back) == 1 else ''} again: relaunching on "
                 f"{len(self.current)} nodes from {saved}")
        self.recoveries.append({"kind": "rejoin", "after_step": self.last_step, "nodes": list(self.current),
                                "back": back, **_seen(ended_at)})  # timed from the stop for the rejoin
        self.resume = True


def _seen(ended_at: float | None) -> dict[str, float]:
    """When the launcher saw a launch end: `_at` (monotonic, for durations) and `detected_at`
    (Unix time, to line a recovery up with a fault injected at a known moment)."""
    at = ended_at if ended_at is not None else time.monotonic()
    return {"_at": at, "detected_at": round(time.time() - (time.monotonic() - at), 2)}
