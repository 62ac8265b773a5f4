"""The quorum engine on a cluster: a lighthouse on the head, one replica group per node.

`train --quorum` (strategy.quorum, `train/strategies/quorum_diloco.py`) launches differently from
one torchrun job over every node:

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
  next sync. No relaunch, no checkpoint; at most `max_starts` times per node.
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


# After the first replica group finished, how long one started again may still log its first sync
# (the final one, its line on the way) before it is stopped as one that can no longer join.
LATE_JOINER_S = 10.0


def lighthouse_url(address: str, port: int | str) -> str:
    host = f"[{address}]" if ":" in address else address
    return f"http://{host}:{port}"


def replica_env(index: int, count: int, lighthouse: str, address: str) -> dict[str, str]:
    """What a node's ranks need to join the quorum (read by `quorum_diloco.ReplicaGroup`)."""
    from vpscluster.train.strategies.quorum_diloco import ADDRESS_ENV, LIGHTHOUSE_ENV, REPLICA_ENV

    # RUST_LOG: torchft's Manager logs every quorum and commit at info, several lines a step.
    return {LIGHTHOUSE_ENV: lighthouse, REPLICA_ENV: f"{index}/{count}", ADDRESS_ENV: address, "RUST_LOG": "warn"}


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

    def synced(self, node: str) -> bool:
        """Whether `node`'s latest start logged its first sync."""
        i = max((i for i, n in enumerate(self.back) if n == node), default=None)
        return i is not None and self.first_sync_at[i] is not None
    failed: str | None = None  # the launch failed: the node to blame (the head for the lighthouse)
    lighthouse_ended: bool = False
    interrupted: bool = False
    silent_s: float | None = None


def first_sync_watch(w: Watched, node: str, on_line):
    """`on_line` for a restarted node's output that also notes its first outer sync's hash line
    (`strategy.sync_hashes`) in `w.first_sync_at`: from then on it trains in the quorum."""
    from vpscluster.launch.logs import split_rank
    from vpscluster.train.strategies.diloco import parse_sync_hash

    i = max(i for i, n in enumerate(w.back) if n == node)  # this start of it

    def line(stream: str, text: str) -> None:
        if w.first_sync_at[i] is None and parse_sync_hash(split_rank(text)[1]) is not None:
            w.first_sync_at[i] = time.monotonic()
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
    polled = float("-inf")
    rejoined: set[asyncio.Future] = set()  # waits of the replica groups started again
    dropped: dict[asyncio.Future, asyncio.Future] = {}  # such a wait -> its stop, once the run ended without it
    ended_at: float | None = None  # when the first replica group finished
    try:
        while pending or starting:
            extra = ({probe} if probe else set()) | set(starting)
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
            for t in [t for t in done if t in starting]:
                node = starting.pop(t)
                if t.exception() is not None:
                    say(f"node {node}: could not start its replica group again: {t.exception()}")
                    if starts[node] < rejoin.max_starts:
                        out.append(node)
                    continue
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
        for t in (stop, beacon, *pending, *([probe] if probe else []), *starting, *dropped.values()):
            t.cancel()
