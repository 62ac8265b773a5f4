"""launch/grow.py: the cluster file edited while a quorum job runs (the sandbox test adds a real node)."""

from __future__ import annotations

import dataclasses
import os

import pytest
import yaml

from vpscluster.cluster.inventory import load_cluster
from vpscluster.errors import UserError
from vpscluster.launch.grow import ClusterFileWatch, extended


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
