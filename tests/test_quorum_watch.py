"""The quorum engine's launch loop (`launch.quorum.watch`) with real local processes standing in
for the replica groups: a lost node that answers again is started again, its first sync noted;
one that keeps failing stays out after `max_starts`; one started again that has not joined when
the others finish is stopped rather than left to wait out its quorum timeout.

The sandbox test (tests/test_quorum_sandbox.py) runs the whole path with torchft; these pin the
loop's own decisions in a second each.
"""

from __future__ import annotations

import asyncio
import time

from vpscluster.cluster.local import LocalExecutor
from vpscluster.cluster.node import Node
from vpscluster.launch import quorum
from vpscluster.launch.quorum import Rejoin, Watched, first_sync_watch, watch
from vpscluster.train.strategies.diloco import sync_hash_line

SYNC = sync_hash_line(0, 1, 10, 3, "ab" * 32)


class Lines:
    """What `watch` needs of the log router, with each node's lines kept."""

    def __init__(self) -> None:
        self.lines: list[tuple[str, str]] = []
        self.started, self.last_line_at = True, time.monotonic()

    def for_node(self, node: str):
        return lambda stream, text: self.lines.append((node, text))


async def _run(scripts: dict[str, str], again: list[str], answering, max_starts: int = 2,
               deadline_s: float = 30.0) -> tuple[Watched, list[str], Lines]:
    """Replica groups as shell scripts on local executors, the lighthouse a sleep; node -> the
    scripts of its restarts in `again` (one per start, in order)."""
    ex = {n: LocalExecutor(Node(name=n, host="127.0.0.1", local=True)) for n in [*scripts, "head"]}
    router, said, w = Lines(), [], Watched()
    handles = [await ex[n].start(s, on_line=router.for_node(n)) for n, s in scripts.items()]
    lighthouse = await ex["head"].start("sleep 60")
    restarts = list(again)

    async def start(node: str):
        return await ex[node].start(restarts.pop(0), on_line=first_sync_watch(w, node, router.for_node(node)))

    async def answers(nodes: list[str]) -> list[str]:
        return [n for n in nodes if answering(n)]

    try:
        await asyncio.wait_for(watch(handles, lighthouse, asyncio.Event(), router, None, said.append,
                                     Rejoin(answers, start, 0.2, max_starts), w), deadline_s)
    finally:
        for h in [*handles, lighthouse]:
            await h.stop(1.0)
    return w, said, router


def test_a_lost_node_that_answers_again_is_started_again_and_its_first_sync_noted():
    async def main():
        survivors = f"sleep 3; echo '{SYNC}'"
        return await _run({"node-1": survivors, "node-2": survivors, "node-3": "exit 1"},
                          again=[f"sleep 0.5; echo '{SYNC}'; sleep 1"], answering=lambda n: True)

    w, said, router = asyncio.run(main())
    assert w.failed is None and w.lost == ["node-3"] and w.back == ["node-3"], (w, said)
    assert w.first_sync_at[0] > w.back_at[0] and w.synced("node-3"), w
    assert ("node-3", SYNC) in router.lines
    assert any("node node-3 answers again" in s for s in said), said


def test_a_node_that_keeps_failing_stays_out_after_max_starts():
    async def main():
        return await _run({"node-1": "sleep 4", "node-2": "sleep 4", "node-3": "exit 1"},
                          again=["exit 3", "exit 3"], answering=lambda n: True, max_starts=2)

    w, said, _ = asyncio.run(main())
    assert w.failed is None and w.lost == ["node-3"] * 3 and w.back == ["node-3"] * 2, (w, said)
    assert any("start 2 of 2" in s for s in said), said


def test_a_node_that_does_not_answer_is_not_started_again():
    async def main():
        return await _run({"node-1": "sleep 2", "node-2": "sleep 2", "node-3": "exit 1"},
                          again=[], answering=lambda n: False)

    w, said, _ = asyncio.run(main())
    assert w.failed is None and w.lost == ["node-3"] and w.back == [], (w, said)


def test_a_restarted_group_not_joined_when_the_others_finish_is_stopped(monkeypatch):
    monkeypatch.setattr(quorum, "LATE_JOINER_S", 0.5)

    async def main():
        t0 = time.monotonic()
        w, said, _ = await _run({"node-1": "sleep 2", "node-2": "sleep 2", "node-3": "exit 1"},
                                again=["sleep 60"], answering=lambda n: True)
        return w, said, time.monotonic() - t0

    w, said, took = asyncio.run(main())
    assert took < 15, took  # not the restarted one's 60 s
    assert w.failed is None and w.lost == ["node-3"] and w.back == ["node-3"], (w, said)
    assert w.first_sync_at == [None] and not w.synced("node-3"), w
    assert any("finished before its restarted replica group joined" in s for s in said), said


async def _run_with_joins(joins: list[str], join_scripts: dict[str, str], refuse: dict[str, str],
                          deadline_s: float = 30.0) -> tuple[Watched, list[str], Lines]:
    """Two replica groups that sync after 3 s; `joins` appear (once) in the cluster file at the
    first look; `join(node)` starts `join_scripts[node]`, or fails with `refuse[node]`."""
    from vpscluster.errors import RemoteError
    from vpscluster.launch.quorum import join_sync_watch

    ex = {n: LocalExecutor(Node(name=n, host="127.0.0.1", local=True)) for n in ["node-1", "node-2", "head", *joins]}
    router, said, w = Lines(), [], Watched()
    handles = [await ex[n].start(f"sleep 3; echo '{SYNC}'", on_line=router.for_node(n)) for n in ("node-1", "node-2")]
    lighthouse = await ex["head"].start("sleep 60")
    offered = list(joins)

    async def joiners():
        new = [(n, 1700000000.0) for n in offered]
        offered.clear()
        return new

    async def join(node: str):
        if node in refuse:
            raise RemoteError(refuse[node])
        return await ex[node].start(join_scripts[node], on_line=join_sync_watch(w, node, router.for_node(node)))

    async def answers(nodes):
        return []

    async def start(node):
        raise AssertionError("no node is lost here")

    try:
        await asyncio.wait_for(watch(handles, lighthouse, asyncio.Event(), router, None, said.append,
                                     Rejoin(answers, start, 0.2, 2, joiners=joiners, join=join), w), deadline_s)
    finally:
        for h in [*handles, lighthouse]:
            await h.stop(1.0)
    return w, said, router


def test_a_node_added_to_the_running_job_starts_a_replica_group_and_its_first_sync_is_noted():
    w, said, router = asyncio.run(_run_with_joins(["node-4"], {"node-4": f"sleep 0.5; echo '{SYNC}'; sleep 1"}, {}))
    assert w.failed is None and w.lost == [] and w.joined == ["node-4"], (w, said)
    assert w.joined_file_at == [1700000000.0] and w.join_sync_at[0] is not None and w.join_sync_at[0] > w.joined_at[0]
    assert w.synced("node-4") and ("node-4", SYNC) in router.lines
    assert any("node node-4 added to the cluster file" in s for s in said), said


def test_an_added_node_that_fails_its_checks_gets_one_line_and_the_job_goes_on():
    why = "pre-flight: PyTorch versions differ across nodes: 2.5.1 on node-1, node-2; 2.4.0 on node-4; install it"
    w, said, _ = asyncio.run(_run_with_joins(["node-4"], {}, {"node-4": why}))
    assert w.failed is None and w.lost == [] and w.joined == ["node-4"] and w.join_sync_at == [None], (w, said)
    line = next(s for s in said if "not added" in s)
    assert line.startswith("node node-4 not added to the running job: pre-flight: PyTorch versions differ") and \
        "the job goes on without it" in line and "\n" not in line, line
