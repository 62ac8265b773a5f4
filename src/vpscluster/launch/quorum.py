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
  takes over, as documented for the lighthouse's loss in `launch/lighthouse.py`.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from vpscluster.errors import RemoteError


@dataclass(frozen=True)
class QuorumPlan:
    """The lighthouse's settings for one launch."""

    min_replicas: int
    heartbeat_timeout_ms: int = 2000
    # Long on purpose (`launch/lighthouse.py`): a slow node that still heartbeats is waited for.
    join_timeout_ms: int = 60000
    ready_timeout_s: float = 40.0  # the head's Python start plus the binary's (nodeside waits 20 s)


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
class Watched:
    """What `watch` saw: the nodes lost on the way, and why the launch ended."""

    lost: list[str] = field(default_factory=list)  # nodes whose replica group failed, in order
    lost_at: dict[str, float] = field(default_factory=dict)  # node -> time.monotonic() it was seen
    failed: str | None = None  # the launch failed: the node to blame (the head for the lighthouse)
    lighthouse_ended: bool = False
    interrupted: bool = False
    silent_s: float | None = None


async def watch(handles, lighthouse, interrupted: asyncio.Event, router, silence_limits_s, say) -> Watched:
    """Wait until every replica group ended, going on past the ones that fail; return early on an
    interrupt, a long silence, or the lighthouse ending (the relaunch path's cue)."""
    w = Watched()
    waits = {asyncio.ensure_future(h.wait()): h for h in handles}
    beacon = asyncio.ensure_future(lighthouse.wait())
    stop = asyncio.ensure_future(interrupted.wait())
    pending = set(waits)
    ok = []
    try:
        while pending:
            done, _ = await asyncio.wait(pending | {stop, beacon}, timeout=1.0, return_when=asyncio.FIRST_COMPLETED)
            if stop in done:
                w.interrupted = True
                return w
            if beacon in done:
                w.lighthouse_ended, w.failed = True, lighthouse.node
                say(f"the quorum's lighthouse on {lighthouse.node} ended (exit status {lighthouse.returncode}): "
                    "stopping the run; the relaunch path takes over")
                return w
            for t in done:
                pending.discard(t)
                node = waits[t].node
                if t.result() == 0:
                    ok.append(node)
                    continue
                w.lost.append(node)
                w.lost_at[node] = time.monotonic()
                if pending:
                    say(f"node {node} failed (exit status {t.result()}); the {len(pending)} other replica group"
                        f"{'s' if len(pending) != 1 else ''} train on without it (the quorum leaves it out)")
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
        for t in (stop, beacon, *pending):
            t.cancel()
