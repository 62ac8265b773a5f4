"""The launcher's recovery helpers that need no node: which cluster a relaunch runs on."""

from __future__ import annotations

import asyncio

import pytest

from vpscluster.cluster.node import Cluster, Node
from vpscluster.launch import recovery


def _cluster(head: str = "a") -> Cluster:
    return Cluster(nodes=tuple(Node(n, f"10.0.0.{i}") for i, n in enumerate("abcd", 1)), head=head, connect_timeout_s=1.0)


def test_subset_keeps_the_file_order_and_the_head_where_it_can():
    part = recovery.subset(_cluster("b"), ["d", "b", "a"])
    assert [n.name for n in part.nodes] == ["a", "b", "d"] and part.head == "b"
    assert part.connect_timeout_s == 1.0  # everything else is the cluster's


def test_subset_moves_the_rendezvous_when_the_head_is_gone():
    part = recovery.subset(_cluster("a"), ["c", "d"])
    assert [n.name for n in part.nodes] == ["c", "d"] and part.head == "c"
    with pytest.raises(ValueError):
        recovery.subset(_cluster(), [])


def test_nothing_to_ask_or_reap_for_no_nodes():
    assert asyncio.run(recovery.answering(_cluster(), [])) == []
    assert asyncio.run(recovery.reap_left(_cluster(), [], ["id"], 1.0)) == []


def test_a_node_nobody_listens_on_does_not_answer():
    # 127.0.0.1 port 9 (discard) refuses at once: counted out within the connect time-out.
    cluster = Cluster(nodes=(Node("x", "127.0.0.1", port=9),), head="x", connect_timeout_s=2.0)
    assert asyncio.run(asyncio.wait_for(recovery.answering(cluster, ["x"]), 20)) == []
