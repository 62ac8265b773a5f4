"""launch/grow.py: the cluster file edited while a quorum job runs (the sandbox test adds a real node)."""

from __future__ import annotations

import dataclasses
import os

import pytest
import yaml

from vpscluster.cluster.inventory import load_cluster
from vpscluster.errors import UserError
from vpscluster.launch.grow import ClusterFileWatch, extended, removal_refused


def _write(path, nodes: list[tuple[str, str]]) -> None:
    doc = {"head": nodes[0][0], "nodes": [{"name": n, "host": h, "workdir": f"/tmp/{n}"} for n, h in nodes]}
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        yaml.safe_dump(doc, f)
    os.replace(tmp, path)


def test_the_watch_reports_each_added_node_once_and_a_broken_file_in_one_line(tmp_path):
    path = tmp_path / "cluster.yaml"
    _write(path, [("node-1", "10.0.0.1"), ("node-2", "10.0.0.2")])
    watch = ClusterFileWatch(str(path), ["node-1", "node-2"])
    assert watch.new() == []  # the file as the run started
    assert watch.new() == []  # unchanged: not even read
    _write(path, [("node-1", "10.0.0.1"), ("node-2", "10.0.0.2"), ("node-3", "10.0.0.3")])
    (node,) = watch.new()
    assert node.name == "node-3" and node.host == "10.0.0.3" and watch.changed_at is not None
    assert watch.new() == []
    path.write_text("head: node-1\nnodes: [{name: node-1, host: 10.0.0.1}, {name: node-9}]\n")
    with pytest.raises(UserError) as e:
        watch.new()
    assert str(e.value) == f"{path}: nodes[1].host: None is not a host; give an IP address or DNS name", e.value
    watch.forget("node-3")  # its start failed: offered again at the next change
    _write(path, [("node-1", "10.0.0.1"), ("node-2", "10.0.0.2"), ("node-3", "10.0.0.3")])
    assert [n.name for n in watch.new()] == ["node-3"]


def test_the_watch_reports_each_removed_node_once_and_a_kept_one_again_at_the_next_change(tmp_path):
    path = tmp_path / "cluster.yaml"
    three = [("node-1", "10.0.0.1"), ("node-2", "10.0.0.2"), ("node-3", "10.0.0.3")]
    _write(path, three)
    watch = ClusterFileWatch(str(path), ["node-1", "node-2", "node-3"])
    assert watch.new() == [] and watch.removed() == []
    _write(path, three[:2])
    assert watch.new() == [] and watch.removed() == ["node-3"]
    assert watch.new() == [] and watch.removed() == []  # once
    _write(path, three[1:2])  # the head too: reported, and its removal refused by the launcher (kept)
    assert watch.new() == [] and watch.removed() == ["node-1"]
    watch.keep("node-1")
    os.utime(path, ns=(os.stat(path).st_mtime_ns + 10**9,) * 2)  # saved again, still without it
    assert watch.new() == [] and watch.removed() == ["node-1"]
    _write(path, three)  # both put back: new nodes again (node-3 drained: it joins as a new one)
    assert sorted(n.name for n in watch.new()) == ["node-1", "node-3"] and watch.removed() == []


def test_removing_the_head_or_going_below_the_quorum_minimum_is_refused_in_one_line():
    assert removal_refused("node-3", "node-1", present=3, min_replicas=2) is None
    head = removal_refused("node-1", "node-1", present=3, min_replicas=2)
    assert head.startswith("node node-1 stays: it is the head (it runs the quorum's lighthouse)") and "\n" not in head
    few = removal_refused("node-2", "node-1", present=2, min_replicas=2)
    assert few.startswith("node node-2 stays: draining it would leave 1 replica group, fewer than the quorum's "
                          "minimum of 2 (--min-nodes)"), few


def test_the_launch_loop_drains_a_removed_node_and_refuses_the_head(tmp_path):
    """`quorum.watch` with local processes as replica groups: node-3, removed, gets its drain file,
    leaves (its DRAINED line, exit 0) and is reported once as drained at its step, cleaned up and
    not counted as the run's end (the others go on, not started again); the head's removal is refused."""
    import asyncio
    import time

    from vpscluster.cluster.local import LocalExecutor
    from vpscluster.cluster.node import Node
    from vpscluster.launch.quorum import Rejoin, Watched, drain_watch, watch

    drain = tmp_path / "drain"
    scripts = {"node-1": "sleep 4; echo done", "node-2": "sleep 4; echo done",
               "node-3": f"while [ ! -e {drain} ]; do sleep 0.05; done; "
                         "echo 'replica group 2: drained at step 35: left the quorum after outer step 7' >&2"}
    lines: list[tuple[str, str]] = []

    class Router:
        started, last_line_at = True, time.monotonic()

    async def run():
        ex = {n: LocalExecutor(Node(name=n, host="127.0.0.1", local=True)) for n in [*scripts, "lh"]}
        w, said, cleaned, kept = Watched(), [], [], []
        handles = [await ex[n].start(s, on_line=drain_watch(w, n, lambda st, t, n=n: lines.append((n, t))))
                   for n, s in scripts.items()]
        lighthouse = await ex["lh"].start("sleep 30")
        removed = [["node-1", "node-3"]]

        async def touch(node):
            drain.touch()

        async def none():
            return []

        async def answers(nodes):
            return []

        async def start(node):
            raise AssertionError(f"{node} started again")

        async def cleanup(node):
            cleaned.append(node)

        rejoin = Rejoin(answers, start, 0.2, 2, joiners=none, join=start,
                        leavers=lambda: removed.pop() if removed else [], drain=touch, drained=cleanup,
                        keep=kept.append, head="node-1", min_replicas=2)
        try:
            await asyncio.wait_for(watch(handles, lighthouse, asyncio.Event(), Router(), None, said.append, rejoin, w), 20)
        finally:
            for h in [*handles, lighthouse]:
                await h.stop(1.0)
        return w, said, cleaned, kept, {h.node: h.returncode for h in handles}

    w, said, cleaned, kept, codes = asyncio.run(run())
    assert w.drained == ["node-3"] and w.drained_step == [35] and w.removed == ["node-3"], (w, said)
    assert w.lost == [] and w.failed is None and codes == {"node-1": 0, "node-2": 0, "node-3": 0}
    assert cleaned == ["node-3"] and kept == ["node-1"], said
    assert said.count("node-3 drained at step 35: removed from the cluster file") == 1, said
    assert any(s.startswith("node node-1 stays: it is the head") for s in said), said


def test_an_added_node_on_a_public_address_is_refused_without_an_overlay(tmp_path):
    path = tmp_path / "cluster.yaml"
    _write(path, [("node-1", "10.0.0.1"), ("node-2", "10.0.0.2"), ("node-3", "8.8.8.8")])
    whole = load_cluster(path)
    running = type(whole)(nodes=whole.nodes[:2], head="node-1", source=str(path))
    with pytest.raises(UserError) as e:
        extended(running, whole.nodes[2])
    assert str(e.value).startswith("refusing to launch over public addresses: node-3 (8.8.8.8)"), e.value
    grown = extended(running, dataclasses.replace(whole.nodes[2], host="10.0.0.3"))
    assert [n.name for n in grown.nodes] == ["node-1", "node-2", "node-3"] and grown.head == "node-1"


def test_an_added_node_gets_a_fresh_replica_id_and_the_planned_ones_keep_their_shards():
    from pathlib import Path

    from vpscluster.cluster.node import Cluster, Node
    from vpscluster.launch.commands import Program
    from vpscluster.launch.pipeline import Job, build_commands
    from vpscluster.launch.preflight import NodeState
    from vpscluster.launch.quorum import QuorumPlan

    nodes = tuple(Node(f"n{i}", f"10.0.0.{i}") for i in range(1, 6))
    job = Job(cluster=Cluster(nodes=nodes, head="n1"), program=Program("module", "x", ()), run_dir=Path("/tmp/r"),
              run_id="r", quorum=QuorumPlan(min_replicas=2))
    states = {n.name: NodeState(n.name, n.host, "/w") for n in nodes}
    # n4's join failed after index 3 was handed out: n5 was given 4, and the next node 5.
    indexes = {"n1": 0, "n2": 1, "n3": 2, "n4": 5, "n5": 4}
    groups = {}
    for name in ("n2", "n4", "n5"):
        (c,) = build_commands(job, states, {}, "id", 1, {name: 100}, "http://h:1", planned=3, only=name, indexes=indexes)
        (groups[name],) = [w.split("=", 1)[1] for w in c.shell().split() if w.startswith("VPSC_REPLICA_GROUP=")]
    assert groups == {"n2": "1/3", "n4": "5/6", "n5": "4/5"}, groups
