"""The launcher's recovery helpers that need no node: which cluster a relaunch runs on."""

from __future__ import annotations

import asyncio
import json

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
    assert asyncio.run(recovery.ready(_cluster(), [])) == []
    assert asyncio.run(recovery.reap_left(_cluster(), [], ["id"], 1.0)) == []


def test_a_node_nobody_listens_on_does_not_answer():
    # 127.0.0.1 port 9 (discard) refuses at once: counted out within the connect time-out.
    cluster = Cluster(nodes=(Node("x", "127.0.0.1", port=9),), head="x", connect_timeout_s=2.0)
    assert asyncio.run(asyncio.wait_for(recovery.ready(cluster, ["x"]), 20)) == []


def _steps(first: int, last: int, launch: str, evals_every: int = 10) -> list[dict]:
    out = []
    for s in range(first, last + 1):
        out.append({"step": s, "loss": 1.0, "tokens": 100, "launch": launch})
        if s % evals_every == 0:
            out.append({"step": s, "val_loss": 2.0, "launch": launch})
    return out


def test_metrics_of_launches_on_different_heads_are_merged():
    """The head was cut off at step 10 (its file unreachable), node-2 led steps 6-39 from the
    checkpoint of step 5, then node-1 came back and led from step 39: the run's metrics hold
    every step once, each from the launch whose training counted."""
    from vpscluster.train.metrics import merge_launch

    history: list[dict] = []  # launch 1's file could not be fetched (its node was cut off)
    history = merge_launch(history, _steps(6, 39, "2"), resumed_from=5)
    launch3_file = _steps(1, 10, "1") + _steps(40, 70, "3")  # node-1's old lines, kept up to step 39
    merged = merge_launch(history, launch3_file, resumed_from=39)
    steps = [x["step"] for x in merged if "loss" in x]
    assert steps == list(range(1, 71))
    by_step = {x["step"]: x["launch"] for x in merged if "loss" in x}
    assert [by_step[s] for s in (1, 5, 6, 10, 39, 40, 70)] == ["1", "1", "2", "2", "2", "3", "3"]
    # the evaluation at step 10 is launch 2's (launch 1's training past step 5 was thrown away)
    assert [(x["step"], x["launch"]) for x in merged if "val_loss" in x] == [
        (10, "2"), (20, "2"), (30, "2"), (40, "3"), (50, "3"), (60, "3"), (70, "3")]
    assert merged.index(next(x for x in merged if x["step"] == 10 and "val_loss" in x)) == \
        merged.index(next(x for x in merged if x["step"] == 10 and "loss" in x)) + 1  # step, then its evaluation


def test_a_restart_on_the_same_head_replaces_the_steps_it_redid(tmp_path):
    from vpscluster.launch.train import _merge_metrics
    from vpscluster.train.metrics import write_metrics

    path = tmp_path / "metrics.jsonl"
    write_metrics(path, _steps(1, 12, "1"))  # launch 1 failed at step 12; its file was fetched
    history = _merge_metrics(path, [], [str(path)], resumed_from=0)
    write_metrics(path, _steps(1, 10, "1") + _steps(11, 20, "2"))  # the node truncated at 10, then launch 2
    history = _merge_metrics(path, history, [str(path)], resumed_from=10)
    assert [x["step"] for x in history if "loss" in x] == list(range(1, 21))
    assert {x["launch"] for x in history if x["step"] > 10} == {"2"}
    # A launch whose file could not be fetched changes nothing, and the file keeps the history.
    path.write_text('{"step": 1, "loss"')  # e.g. a fetch torn half-way
    assert _merge_metrics(path, history, [], resumed_from=20) == history
    assert [x["step"] for x in map(json.loads, path.read_text().splitlines()) if "loss" in x] == list(range(1, 21))


def _mixed(tmp_path) -> Cluster:
    """Two nodes on this machine (they answer) and one nobody listens on (it does not)."""
    return Cluster(nodes=(Node("a", "127.0.0.1", local=True), Node("node-1", "127.0.0.1", local=True),
                          Node("node-10", "127.0.0.1", port=9)),
                   head="a", connect_timeout_s=2.0, source=str(tmp_path / "c.yaml"))


def test_a_relaunch_that_failed_before_training_blames_the_node_that_is_not_ready(tmp_path):
    from vpscluster.errors import RemoteError

    cluster = _mixed(tmp_path)
    every = ["a", "node-1", "node-10"]
    assert asyncio.run(asyncio.wait_for(recovery.ready(cluster, every), 20)) == ["a", "node-1"]
    # Not answering outweighs what the message says (the first error of a gather may be anyone's).
    assert asyncio.run(recovery.at_fault(cluster, every, RemoteError("node node-1: could not write"))) == ["node-10"]
    # All ready: the node the error names (node-1, not its prefix of node-10), none when it names none.
    both = ["a", "node-1"]
    assert asyncio.run(recovery.at_fault(cluster, both, RemoteError("node node-1: could not write x"))) == ["node-1"]
    assert asyncio.run(recovery.at_fault(cluster, both, RemoteError("sync code: node-10 (1.2.3.4) timed out"))) == []
    from vpscluster.errors import UserError

    assert asyncio.run(recovery.at_fault(cluster, both, UserError("pre-flight: node-1: disk full"))) == []


def test_a_node_whose_overlay_is_down_is_not_ready(tmp_path):
    """It answers, but its interface does not carry its overlay address (a rebooted VPS whose
    wireguard-go died): not ready, so the rejoin watcher does not take it back and a failed
    relaunch leaves it out. Here: this machine has no vpsc-test0 carrying 10.77.0.2."""
    from vpscluster.cluster import overlay

    cluster = _mixed(tmp_path)
    overlay.save(cluster, "vpsc-test0", {"a": "127.0.0.1", "node-1": "10.77.0.2", "node-10": "10.77.0.3"},
                 "10.77.0.0/24")
    assert overlay.load(cluster).interface == "vpsc-test0"
    assert asyncio.run(asyncio.wait_for(recovery.ready(cluster, ["a", "node-1"]), 20)) == []
    # With lo as "the overlay": a (127.0.0.1) is on it, node-1 (10.77.0.2) is not.
    overlay.save(cluster, "lo", {"a": "127.0.0.1", "node-1": "10.77.0.2", "node-10": "10.77.0.3"}, "10.77.0.0/24")
    assert asyncio.run(asyncio.wait_for(recovery.ready(cluster, ["a", "node-1"]), 20)) == ["a"]
    assert asyncio.run(recovery.wait_for_any(cluster, ["a", "node-1"], 0.1)) == ["a"]


# ---------------------------------------------------------------- survival by default


def _recovery(**kw):
    from vpscluster.train.config import RecoveryConfig

    return RecoveryConfig(**kw)


def test_recovery_is_on_by_default_on_a_cluster_while_half_its_nodes_remain():
    assert [recovery.default_min_nodes(n) for n in (1, 2, 3, 4, 5, 8)] == [1, 1, 2, 2, 3, 4]
    plan = recovery.policy(_recovery(), 3, local=False)
    assert plan.on and plan.by_default and plan.min_nodes == 2 and plan.max_restarts == recovery.default_restarts(3) == 6
    assert plan.line() == ("recovery: on (after a failure the run relaunches from the last checkpoint on the nodes "
                           "that answer while at least 2 of 3 nodes remain (half, rounded up; --min-nodes M sets it), "
                           "up to 6 restarts; --max-restarts 0 turns it off)")
    two = recovery.policy(_recovery(), 2, local=False)  # a two-node run goes on with one
    assert two.on and two.min_nodes == 1 and two.max_restarts == 4


def test_recovery_flags_override_the_default_and_zero_turns_it_off():
    off = recovery.policy(_recovery(max_restarts=0), 3, local=False)
    assert not off.on and off.line() == "recovery: off (--max-restarts 0: the first failure ends the run)"
    given = recovery.policy(_recovery(max_restarts=1, min_nodes=3), 3, local=False)
    assert (given.max_restarts, given.min_nodes, given.by_default) == (1, 3, False)
    assert "at least 3 of 3 nodes remain, up to 1 restart;" in given.line()
    floor_only = recovery.policy(_recovery(min_nodes=3), 4, local=False)  # the default count, the user's floor
    assert (floor_only.max_restarts, floor_only.min_nodes, floor_only.by_default) == (8, 3, False)


def test_no_node_to_lose_keeps_recovery_off_unless_asked():
    local = recovery.policy(_recovery(), 1, local=True)
    assert not local.on and local.line().startswith("recovery: off (the local cluster has no node to lose")
    assert recovery.policy(_recovery(max_restarts=2), 1, local=True).max_restarts == 2
    one = recovery.policy(_recovery(), 1, local=False)
    assert not one.on and one.line().startswith("recovery: off (one node")


@pytest.mark.parametrize("strategy", ["ddp", "diloco"])
def test_fewer_nodes_need_no_more_memory_per_rank(strategy):
    """Why memory does not raise the default floor: every node holds a whole replica, so a rank
    on the survivors needs at most what it needed on all the nodes (plan/memory.py)."""
    from vpscluster.plan import memory
    from vpscluster.plan.shapes import load_model

    model = load_model("small")
    for wire in ("fp32", "bf16", "int8"):
        need = [memory.estimate(model, strategy, world, mixed_precision=False, wire_dtype=wire).total_bytes
                for world in (1, 2, 3, 4, 8)]
        assert need == sorted(need), (wire, need)  # never more on fewer ranks


def test_supervisor_follows_rank0_and_refuses_to_go_on_below_min_nodes():
    """The supervisor's plain state: the step resumed from, the last step seen (a script's session
    says only its checkpoints), a stop's checkpoint, the recoveries for the report; a failure that
    leaves fewer than --min-nodes ends the run in one line naming how to go on."""
    from vpscluster.launch.supervisor import RecoveryFailed, Supervisor

    said = []
    sup = Supervisor(_cluster(), recovery.Policy(max_restarts=3, min_nodes=3, nodes=4, by_default=False),
                     rejoin_poll_s=1.0, stop_grace_s=1.0, continue_with="vpscluster run --resume R -- python x.py",
                     min_nodes_given=True, say=said.append)
    sup.watch({"event": "checkpoint", "step": 10})
    assert sup.last_step == 10 and sup.saved and sup.stop_checkpoint is None
    sup._go_on_without(["d"], "node d failed", "d", None)
    assert sup.current == ["a", "b", "c"] and sup.resume and sup.restarts == 1
    assert said[-1] == "node d failed; relaunching on 3 nodes from the last checkpoint without d (restart 1 of 3)"
    sup.watch({"event": "resume", "step": 10})
    assert sup.resumed_from == 10
    sup.watch({"event": "stopping", "step": 12})
    assert not sup.stopped_with_checkpoint
    sup.watch({"event": "checkpoint", "step": 12})
    assert sup.stopped_with_checkpoint and sup.stop_checkpoint == 12
    (r,) = sup.record()
    assert (r["kind"], r["out"], r["nodes"], r["after_step"], r["resumed_from_step"]) == \
        ("restart", ["d"], ["a", "b", "c"], 10, 10) and "_at" not in r and r["resumed_after_s"] >= 0
    with pytest.raises(RecoveryFailed, match=r"only 2 of 4 nodes answer \(a, b\), fewer than the 3 it needs "
                                             r"\(--min-nodes\).*continue with vpscluster run --resume R"):
        sup._go_on_without(["c"], "node c failed", "c", None)
    assert sup.restarts == 1


def test_a_node_added_during_a_launch_belongs_to_the_run_and_its_join_is_recorded():
    """A node added to the cluster file while a quorum launch ran is part of every later launch
    (a relaunch includes it), and the report's `quorum_join` times its first sync from the file's
    change and from when the launcher saw it."""
    import time

    from vpscluster.launch.pipeline import LaunchResult
    from vpscluster.launch.supervisor import Supervisor

    three = Cluster(nodes=_cluster().nodes[:3], head="a")
    sup = Supervisor(three, recovery.Policy(max_restarts=3, min_nodes=2, nodes=3, by_default=True),
                     rejoin_poll_s=1.0, stop_grace_s=1.0, continue_with="x")
    now, wall = time.monotonic(), time.time()
    sup.step_seen = [(now - 20, 4), (now - 1, 9)]
    result = LaunchResult(ok=True, exit_status=0, run_dir="r", rdzv_id="x", nodes=[],
                          joined_nodes=["d", "e"], joined_at=[now - 10, now - 5], joined_file_at=[wall - 12, wall - 5],
                          join_sync_at=[now - 2, None], added=[_cluster().nodes[3]])
    sup._take_added(result)
    assert sup.everyone == sup.current == ["a", "b", "c", "d"] and [n.name for n in sup.cluster.nodes] == sup.everyone
    d, e = sup.record()
    assert (d["kind"], d["joined"], d["joined_ok"], d["after_step"], d["first_sync_after_s"]) == \
        ("quorum_join", ["d"], True, 4, 8.0), d
    assert abs(d["first_sync_after_added_s"] - 10.0) < 0.2, d
    assert (e["joined"], e["joined_ok"]) == (["e"], False) and "first_sync_after_s" not in e, e


def test_a_quorum_launch_whose_lighthouse_ended_is_relaunched_even_without_a_checkpoint(monkeypatch):
    """`run` does not relaunch a script that failed with no checkpoint while every node answers
    (its own error would come again), but the lighthouse's end is the run's failure, not the
    script's: `run --quorum` relaunches it (the documented fallback), as `train --quorum` does."""
    from types import SimpleNamespace

    from vpscluster.launch import pipeline
    from vpscluster.launch.pipeline import LaunchResult
    from vpscluster.launch.supervisor import Supervisor

    def supervise(outcomes):
        launched = []

        def launch(job):
            launched.append(job)
            return outcomes[len(launched) - 1]

        monkeypatch.setattr(pipeline, "launch", launch)
        sup = Supervisor(Cluster(nodes=_cluster().nodes[:3], head="a"),
                         recovery.Policy(max_restarts=3, min_nodes=2, nodes=3, by_default=True), rejoin_poll_s=1.0,
                         stop_grace_s=1.0, continue_with="x", retry_without_progress=False)
        result = sup.run(lambda cluster, resume: SimpleNamespace(on_event=None, fetch_when_interrupted=None))
        return result, launched, sup

    failed = dict(ok=False, exit_status=1, run_dir="r", rdzv_id="1", nodes=[], failed_node="a")
    ok = LaunchResult(ok=True, exit_status=0, run_dir="r", rdzv_id="2", nodes=[])
    result, launched, sup = supervise([LaunchResult(**failed, error="the quorum's lighthouse on a ended",
                                                    lighthouse_ended=True), ok])
    assert result.ok and len(launched) == 2 and launched[1].relaunch and sup.restarts == 1
    assert sup.record()[0]["kind"] == "restart"
    result, launched, sup = supervise([LaunchResult(**failed, error="node a failed (exit status 1)"), ok])
    assert not result.ok and len(launched) == 1 and sup.restarts == 0
