"""The quorum engine on a cluster: a lighthouse on the head, one replica group per node.

`train --quorum` and `run --quorum` (strategy.quorum, `train/strategies/quorum_diloco.py`; `run`'s
script gets the engine from `session.start()`) launch differently from one torchrun job over every
node (`quorum_launch`; the same pipeline stages otherwise):

- the head runs torchft's lighthouse (`nodeside/lighthouse.py`), started like the workers (the
  executor, under the node-side guard, tagged with the launch id, so teardown finds it), bound
  to the head's cluster address (the overlay's, where there is one) on a free port; its
  `min_replicas` is the run's recovery floor (`recovery.policy`: half the nodes, rounded up, or
  --min-nodes);
- each node runs torchrun with a rendezvous of its own (`--nnodes 1`, its store on its own
  address and a free port of its own): one replica group, which gets `TORCHFT_LIGHTHOUSE`, its
  `VPSC_REPLICA_GROUP` (INDEX/COUNT: its place in the launch's node list) and
  `VPSC_REPLICA_ADDR` (its cluster address, where peers reach its store and checkpoint server);
- a node that fails does not end the launch (`watch`): the survivors go on, the quorum leaves the
  dead one out at their next sync, and the launch ends when they finish. Only when none
  finished (too few replicas left: their next quorum fails within `quorum_timeout_s`) or when
  the lighthouse ends does the launch fail, and the launcher's relaunch path (launch/recovery.py)
  takes over, as documented for the lighthouse's loss in `launch/lighthouse.py`;
- a lost node that answers again (`recovery.ready`: SSH, and the overlay's interface where there
  is one; asked every `recovery.rejoin_poll_s`) is started again within the launch (`Rejoin`):
  what the launch left there is reaped, its torchrun gets a fresh port and the same replica
  group, and its first quorum finds it behind, so it heals from a peer and takes part from the
  next sync. No relaunch, no checkpoint; at most `max_starts` times per node. It goes through
  the launch's own pre-flight (reachable, workdir, firewall, interface), sync and prepare stages
  for that node first, so one that came back with a wiped disk gets its code, data and run
  configuration again;
- a node added to the cluster file while the job runs (`Rejoin.joiners`, the cluster file looked
  at every `rejoin_poll_s`: launch/grow.py) is checked like any node at the start (pre-flight,
  its environment against the others', the overlay, the firewall), gets the code and data, and
  starts a new replica group with a fresh replica id (`Rejoin.join`): it heals from a peer and
  joins at the next sync. One that fails its checks gets one line and the job goes on;
- a node removed from the cluster file is drained (`Rejoin.drain`: its `DRAIN_FILE` created over
  SSH; launch/grow.py says what is refused): its replica group takes part in one more outer sync
  and exits 0, which `watch` counts as a drain, not as the run's end; the launcher says "NODE
  drained at step N", reaps the node (`Rejoin.drained`) and the run forgets it.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

from vpscluster.errors import RemoteError


@dataclass(frozen=True)
class QuorumPlan:
    """The lighthouse's settings for one launch."""

    min_replicas: int
    heartbeat_timeout_ms: int = 2000
    # Long on purpose (`launch/lighthouse.py`): a slow node that still heartbeats is waited for.
    join_timeout_ms: int = 60000
    ready_timeout_s: float = 40.0  # the head's Python start plus the binary's (nodeside waits 20 s)
    # A lost node that answers again (`recovery.ready`, asked every rejoin_poll_s) is started again
    # within the launch, at most max_starts times per node; 0: it stays out until a relaunch.
    rejoin_poll_s: float = 10.0
    max_starts: int = 2


def quorum_floor(recovery_cfg, nodes: int, local: bool) -> int:
    """The lighthouse's `min_replicas` for a run on `nodes` nodes: its recovery floor
    (`recovery.policy`: `--min-nodes`, else half the nodes, rounded up). `train` and `run` set
    `strategy.quorum_min_replicas` to it once, for the whole cluster (a relaunch on fewer nodes
    keeps it)."""
    from vpscluster.launch.recovery import policy

    return policy(recovery_cfg, nodes, local).min_nodes


def quorum_launch(strategy, rejoin_poll_s: float, nproc_per_node: int) -> tuple[QuorumPlan | None, int]:
    """How `train` and `run` launch `strategy` (a `StrategyConfig`) through the pipeline: with
    `strategy.quorum`, the lighthouse's plan (at least `strategy.quorum_min_replicas` replica
    groups) and one rank per node (its replica group); else (None, `nproc_per_node`): one
    torchrun job over every node."""
    if not strategy.quorum:
        return None, nproc_per_node
    return QuorumPlan(min_replicas=strategy.quorum_min_replicas, rejoin_poll_s=rejoin_poll_s), 1


# After the first replica group finished, how long one started again may still log its first sync
# (the final one, its line on the way) before it is stopped as one that can no longer join.
LATE_JOINER_S = 10.0


def lighthouse_url(address: str, port: int | str) -> str:
    host = f"[{address}]" if ":" in address else address
    return f"http://{host}:{port}"


DRAIN_FILE = "drain"  # in a node's run dir: created by the launcher, it asks the replica to leave at a sync


def replica_env(index: int, count: int, lighthouse: str, address: str, drain_file: str | None = None,
                heartbeat_timeout_ms: int | None = None) -> dict[str, str]:
    """What a node's ranks need to join the quorum (read by `quorum_diloco.ReplicaGroup`);
    `drain_file`: the file whose existence asks it to leave (`Rejoin.drain`)."""
    from vpscluster.train.strategies.quorum_diloco import (ADDRESS_ENV, DRAIN_ENV, HEARTBEAT_ENV, LIGHTHOUSE_ENV,
                                                           REPLICA_ENV)

    # RUST_LOG: torchft's Manager logs every quorum and commit at info, several lines a step.
    env = {LIGHTHOUSE_ENV: lighthouse, REPLICA_ENV: f"{index}/{count}", ADDRESS_ENV: address, "RUST_LOG": "warn"}
    if drain_file:
        env[DRAIN_ENV] = drain_file
    if heartbeat_timeout_ms:
        env[HEARTBEAT_ENV] = str(heartbeat_timeout_ms)
    return env


def lighthouse_argv(python: str, address: str, port: int, plan: QuorumPlan) -> list[str]:
    from vpscluster import nodeside

    return nodeside.command(python, "lighthouse", address, str(port), str(plan.min_replicas),
                            str(plan.join_timeout_ms), str(plan.heartbeat_timeout_ms))


async def start_lighthouse(ex, address: str, port: int, plan: QuorumPlan, launch_id: str, lock_path: str | None,
                           grace_s: float, on_line):
    """Start the lighthouse on the head `ex` (under the node-side guard, tagged with `launch_id`)
    and wait until it listens; its handle. RemoteError (one line, its last output) otherwise."""
    import shlex

    from vpscluster.launch.teardown import guarded
    from vpscluster.nodeside.lighthouse import READY

    ready = asyncio.Event()
    tail: list[str] = []

    def line(stream: str, text: str) -> None:
        tail[:] = (tail + [text.strip()])[-3:]
        if text.startswith(READY):
            ready.set()
        on_line(stream, text)

    from vpscluster.launch.commands import LAUNCH_ID_ENV

    argv = lighthouse_argv(ex.node.python, address, port, plan)
    shell = f"exec env {LAUNCH_ID_ENV}={shlex.quote(launch_id)} {shlex.join(argv)}"
    handle = await ex.start(guarded(ex.node.python, launch_id, shell, grace_s=grace_s, lock_path=lock_path),
                            on_line=line)
    waiter = asyncio.ensure_future(ready.wait())
    ended = asyncio.ensure_future(handle.wait())
    try:
        done, _ = await asyncio.wait({waiter, ended}, timeout=plan.ready_timeout_s,
                                     return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiter.cancel()
        ended.cancel()
    if not ready.is_set():
        why = " ".join(tail) or "no output"
        raise RemoteError(f"node {ex.node.name}: the quorum's lighthouse did not start within "
                          f"{plan.ready_timeout_s:g} s ({why}); check that torchft 0.2.0 is installed in the "
                          f"node's Python ({ex.node.python}), or train without --quorum")
    return handle


@dataclass
class Rejoin:
    """How `watch` starts a lost replica group again: `answers(nodes)` -> those that answer now
    (`recovery.ready`), `start(node)` -> its new handle (the pipeline: what this launch left there
    reaped, a fresh port, the same command under the guard), asked every `poll_s` seconds while a
    node is out, at most `max_starts` times per node (a node that keeps failing stays out)."""

    answers: Callable[[list[str]], Awaitable[list[str]]]
    start: Callable[[str], Awaitable[Any]]
    poll_s: float
    max_starts: int = 2
    # Nodes added to the running job: `joiners()` -> (name, when the cluster file was changed: Unix
    # time or None) of each node new since it was last asked (asked every `poll_s`), `join(node)` -> the handle of its new replica group (its checks, sync
    # and start; an exception: it was not added, the job goes on without it).
    joiners: Callable[[], Awaitable[list[tuple[str, float | None]]]] | None = None
    join: Callable[[str], Awaitable[Any]] | None = None
    # Nodes removed from the cluster file: `leavers()` -> the names removed at the last `joiners()`
    # reading; `drain(node)` asks its replica group to leave at a sync (creates its drain file);
    # `drained(node)` -> after it left: what the launch left there reaped, the node forgotten;
    # `keep(node)`: its removal was refused, the next change of the file offers it again.
    leavers: Callable[[], list[str]] | None = None
    drain: Callable[[str], Awaitable[Any]] | None = None
    drained: Callable[[str], Awaitable[Any]] | None = None
    keep: Callable[[str], None] | None = None
    head: str | None = None  # never drained: it runs the lighthouse
    min_replicas: int = 1  # nor below this many replica groups


@dataclass
class Watched:
    """What `watch` saw: the nodes lost on the way, and why the launch ended."""

    lost: list[str] = field(default_factory=list)  # nodes whose replica group failed, in order
    lost_at: list[float] = field(default_factory=list)  # when each was seen (time.monotonic())
    # Lost nodes started again once they answered (in order), when the launcher saw each answer,
    # and when each restarted replica group logged its first outer sync (it had healed and joined).
    back: list[str] = field(default_factory=list)
    # (Lists in step with `lost` and `back`: a node may go and come back more than once.)
    back_at: list[float] = field(default_factory=list)
    first_sync_at: list[float | None] = field(default_factory=list)
    # Nodes added to the running job (in order), when the launcher saw each in the cluster file,
    # and when each new replica group logged its first outer sync (None: not (yet)).
    joined: list[str] = field(default_factory=list)
    joined_at: list[float] = field(default_factory=list)
    joined_file_at: list[float | None] = field(default_factory=list)  # the file's change (Unix time)
    join_sync_at: list[float | None] = field(default_factory=list)
    # Nodes drained (removed from the cluster file, they left at a sync and exited 0), when the
    # launcher saw each end, and the step after which each left (its DRAINED line; None: not seen).
    drained: list[str] = field(default_factory=list)
    drained_at: list[float] = field(default_factory=list)
    drained_step: list[int | None] = field(default_factory=list)
    drain_steps: dict[str, int] = field(default_factory=dict)  # node -> the step of its last DRAINED line
    removed: list[str] = field(default_factory=list)  # every node out of the run by the file (drained or not)

    def synced(self, node: str) -> bool:
        """Whether `node`'s latest start (a restart, else its join) logged its first sync."""
        i = max((i for i, n in enumerate(self.back) if n == node), default=None)
        if i is not None:
            return self.first_sync_at[i] is not None
        j = max((j for j, n in enumerate(self.joined) if n == node), default=None)
        return j is not None and self.join_sync_at[j] is not None
    failed: str | None = None  # the launch failed: the node to blame (the head for the lighthouse)
    lighthouse_ended: bool = False
    interrupted: bool = False
    silent_s: float | None = None


def first_sync_watch(w: Watched, node: str, on_line):
    """`on_line` for a restarted node's output that also notes its first outer sync's hash line
    (`strategy.sync_hashes`) in `w.first_sync_at`: from then on it trains in the quorum."""

    i = max(i for i, n in enumerate(w.back) if n == node)  # this start of it
    return _noting_first_sync(w.first_sync_at, i, on_line)


def join_sync_watch(w: Watched, node: str, on_line):
    """`first_sync_watch` for a node added to the running job (its first sync in `w.join_sync_at`)."""
    i = max(i for i, n in enumerate(w.joined) if n == node)
    return _noting_first_sync(w.join_sync_at, i, on_line)


def drain_watch(w: Watched, node: str, on_line):
    """`on_line` for a node's output that also notes the step of its DRAINED line in `w.drain_steps`."""
    from vpscluster.launch.logs import split_rank
    from vpscluster.train.strategies.quorum_diloco import drained_step

    def line(stream: str, text: str) -> None:
        step = drained_step(split_rank(text)[1])
        if step is not None:
            w.drain_steps[node] = step
        on_line(stream, text)

    return line


def _noting_first_sync(times: list[float | None], i: int, on_line):
    from vpscluster.launch.logs import split_rank
    from vpscluster.train.strategies.diloco import parse_sync_hash

    def line(stream: str, text: str) -> None:
        if times[i] is None and parse_sync_hash(split_rank(text)[1]) is not None:
            times[i] = time.monotonic()
        on_line(stream, text)

    return line


async def watch(handles, lighthouse, interrupted: asyncio.Event, router, silence_limits_s, say,
                rejoin: Rejoin | None = None, watched: Watched | None = None) -> Watched:
    """Wait until every replica group ended, going on past the ones that fail; return early on an
    interrupt, a long silence, or the lighthouse ending (the relaunch path's cue).

    With `rejoin`, a lost node that answers again while the others train is started again: a
    fresh process whose first quorum finds it behind, so it heals from a peer (θ_global, outer
    momentum, the loop's place) and takes part from the next sync. Its new handle joins `handles`
    (teardown stops it with the rest). Not once a replica group has finished: the run is ending."""
    w = watched if watched is not None else Watched()
    waits = {asyncio.ensure_future(h.wait()): h for h in handles}
    beacon = asyncio.ensure_future(lighthouse.wait())
    stop = asyncio.ensure_future(interrupted.wait())
    pending = set(waits)
    ok: list[str] = []
    out: list[str] = []  # lost, to be started again once they answer
    starts: dict[str, int] = {}
    probe: asyncio.Future | None = None  # rejoin.answers(out), under way
    starting: dict[asyncio.Future, str] = {}  # rejoin.start(node), under way
    joining: dict[asyncio.Future, str] = {}  # rejoin.join(node), under way
    looked: asyncio.Future | None = None  # rejoin.joiners(), under way
    polled = looked_at = float("-inf")
    rejoined: set[asyncio.Future] = set()  # waits of the replica groups started again
    dropped: dict[asyncio.Future, asyncio.Future] = {}  # such a wait -> its stop, once the run ended without it
    ended_at: float | None = None  # when the first replica group finished
    draining: dict[str, float] = {}  # nodes asked to drain -> when (time.monotonic())
    asking: dict[asyncio.Future, str] = {}  # rejoin.drain(node), under way
    cleaning: set[asyncio.Future] = set()  # rejoin.drained(node), under way

    def removed(node: str) -> None:
        """`node` was removed from the cluster file: drain it, or say why it stays."""
        running = {waits[f].node for f in pending if f not in dropped}
        if node in out:
            out.remove(node)
            w.removed.append(node)
            say(f"node {node} removed from the cluster file: it was out of the run already and is not started again")
            return
        if node in starting.values() or node in joining.values():
            say(f"node {node} stays: it is being started; remove it from the cluster file again once it trains")
            rejoin.keep(node)
            return
        if node in draining:
            return
        if node not in running:
            w.removed.append(node)
            say(f"node {node} removed from the cluster file (not running in this launch)")
            return
        why = removal_refused(node, rejoin.head, len(running) - len(draining), rejoin.min_replicas)
        if why:
            say(why)
            rejoin.keep(node)
            return
        draining[node] = time.monotonic()
        say(f"node {node} removed from the cluster file: draining it (it finishes its round, takes part in that "
            "round's outer sync, then leaves the quorum)")
        asking[asyncio.ensure_future(rejoin.drain(node))] = node
    from vpscluster.launch.grow import removal_refused

    try:
        while pending or starting or joining or cleaning:
            extra = ({probe} if probe else set()) | ({looked} if looked else set()) | set(starting) | set(joining) \
                | set(asking) | cleaning
            done, _ = await asyncio.wait(pending | extra | {stop, beacon}, timeout=1.0,
                                         return_when=asyncio.FIRST_COMPLETED)
            if stop in done:
                w.interrupted = True
                return w
            if beacon in done:
                w.lighthouse_ended, w.failed = True, lighthouse.node
                say(f"the quorum's lighthouse on {lighthouse.node} ended (exit status {lighthouse.returncode}): "
                    "stopping the run; the relaunch path takes over")
                return w
            if probe is not None and probe in done:
                back = probe.result() if probe.exception() is None else []
                probe = None
                for node in (n for n in back if n in out and not ok):
                    out.remove(node)
                    starts[node] = starts.get(node, 0) + 1
                    w.back.append(node)
                    w.back_at.append(time.monotonic())
                    w.first_sync_at.append(None)
                    say(f"node {node} answers again: starting its replica group again (it heals from a peer "
                        f"and joins at the next sync; start {starts[node]} of {rejoin.max_starts})")
                    starting[asyncio.ensure_future(rejoin.start(node))] = node
            if looked is not None and looked in done:
                if looked.exception() is not None:
                    say(f"could not look at the cluster file for added nodes: {looked.exception()}")
                new = looked.result() if looked.exception() is None else []
                looked = None
                for node, file_at in new:
                    if ok:  # the run is ending: too late to join
                        say(f"node {node} was added to the cluster file as the run ends: not started")
                        continue
                    w.joined.append(node)
                    w.joined_at.append(time.monotonic())
                    w.joined_file_at.append(file_at)
                    w.join_sync_at.append(None)
                    say(f"node {node} added to the cluster file: checking it (pre-flight, environment, overlay, "
                        "firewall), sending it the code and data, then starting a new replica group (it heals from "
                        "a peer and joins at the next sync)")
                    joining[asyncio.ensure_future(rejoin.join(node))] = node
                for node in (rejoin.leavers() if rejoin.leavers is not None else []):
                    removed(node)
            for t in [t for t in done if t in asking]:
                node = asking.pop(t)
                if t.exception() is not None and node in draining:
                    draining.pop(node)
                    say(f"node {node} stays: could not ask it to drain ({t.exception()}); save the cluster file "
                        "again to retry")
                    rejoin.keep(node)
            for t in [t for t in done if t in cleaning]:
                cleaning.discard(t)
                if t.exception() is not None:
                    say(f"after draining: {t.exception()}")
            for t in [t for t in done if t in starting or t in joining]:
                added = t in joining
                node = joining.pop(t) if added else starting.pop(t)
                if t.exception() is not None:
                    if added:
                        say(f"node {node} not added to the running job: {t.exception()}; the job goes on without "
                            "it (fix that and save the cluster file again to retry)")
                        continue
                    say(f"node {node}: could not start its replica group again: {t.exception()}")
                    if starts[node] < rejoin.max_starts:
                        out.append(node)
                    continue
                if added:
                    say(f"node {node}: its replica group started; it joins the quorum at the next sync")
                h = t.result()
                handles.append(h)
                f = asyncio.ensure_future(h.wait())
                waits[f] = h
                pending.add(f)
                rejoined.add(f)
            for t in [t for t in done if t in waits]:
                pending.discard(t)
                node = waits[t].node
                if t in dropped:  # stopped on purpose: the run ended before it joined
                    continue
                if node in draining:
                    draining.pop(node)
                    if t.result() == 0:  # it took part in its last sync and left the quorum
                        step = w.drain_steps.pop(node, None)
                        w.drained.append(node)
                        w.drained_at.append(time.monotonic())
                        w.drained_step.append(step)
                        w.removed.append(node)
                        say(f"{node} drained at step {step if step is not None else '?'}: removed from the cluster file")
                        cleaning.add(asyncio.ensure_future(rejoin.drained(node)))
                        continue
                    w.lost.append(node)  # failed while draining: out, and not started again (it was removed)
                    w.lost_at.append(time.monotonic())
                    w.removed.append(node)
                    say(f"node {node} failed while draining (exit status {t.result()}); the others train on without it")
                    continue
                if t.result() == 0:
                    ok.append(node)
                    continue
                w.lost.append(node)
                w.lost_at.append(time.monotonic())
                if rejoin is not None and starts.get(node, 0) < rejoin.max_starts and not ok:
                    out.append(node)
                if pending:
                    say(f"node {node} failed (exit status {t.result()}); the {len(pending)} other replica group"
                        f"{'s' if len(pending) != 1 else ''} train on without it (the quorum leaves it out)")
            if ok:
                out.clear()  # the run is ending: no node starts again
                ended_at = ended_at or time.monotonic()
                if time.monotonic() - ended_at > LATE_JOINER_S:
                    # A replica group started again that has not synced yet can no longer join (the
                    # others are done); left alone it would wait out its quorum timeout.
                    for f in [f for f in pending if f in rejoined and f not in dropped
                              and not w.synced(waits[f].node)]:
                        say(f"node {waits[f].node}: the others finished before its restarted replica group "
                            "joined: stopping it")
                        dropped[f] = asyncio.ensure_future(waits[f].stop())
            if out and probe is None and pending and time.monotonic() - polled >= rejoin.poll_s:
                polled = time.monotonic()
                probe = asyncio.ensure_future(rejoin.answers(list(out)))
            if (rejoin is not None and rejoin.joiners is not None and looked is None and pending and not ok
                    and time.monotonic() - looked_at >= rejoin.poll_s):
                looked_at = time.monotonic()
                looked = asyncio.ensure_future(rejoin.joiners())
            if silence_limits_s is not None and pending:
                limit = silence_limits_s[1] if router.started else silence_limits_s[0]
                silent = time.monotonic() - router.last_line_at
                if silent > limit:
                    w.silent_s = silent
                    return w
        if not ok:  # every replica group failed: too few remained for a quorum, or all died
            w.failed = w.lost[0] if w.lost else None
        return w
    finally:
        for t in (stop, beacon, *pending, *([probe] if probe else []), *([looked] if looked else []), *starting,
                  *joining, *dropped.values(), *asking, *cleaning):
            t.cancel()
