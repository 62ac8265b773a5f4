"""The launch pipeline on "nodes" that are this machine (LocalExecutor): no sandbox needed.

Two local nodes run the plain DDP script through the full pipeline (pre-flight, sync, start,
stream, teardown); a silent run is stopped by the watchdog and leaves nothing behind.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest

from vpscluster.cluster.node import Cluster, Node
from vpscluster.launch.commands import LAUNCH_ID_ENV
from vpscluster.launch.pipeline import launch
from vpscluster.launch.run import script_job

SCRIPTS = Path(__file__).parent / "scripts"


def local_cluster(tmp_path, n=2) -> Cluster:
    nodes = tuple(Node(name=f"n{i}", host="127.0.0.1", local=True, python=sys.executable,
                       workdir=str(tmp_path / f"w{i}")) for i in range(n))
    return Cluster(nodes=nodes, head="n0")


def tagged_processes(launch_id: str) -> list[int]:
    tag = f"{LAUNCH_ID_ENV}={launch_id}".encode()
    found = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                if tag in Path(f"/proc/{d}/environ").read_bytes().split(b"\0"):
                    found.append(int(d))
            except OSError:
                pass
    return found


@pytest.mark.slow
def test_two_local_nodes_run_the_ddp_script(tmp_path):
    lines = []
    # Two ranks per node: world size 4, global ranks spread over the two nodes.
    job = script_job(local_cluster(tmp_path), ["python", "ddp_tutorial.py", "--epochs", "1"], sync=str(SCRIPTS),
                     run_dir=str(tmp_path / "run"), nproc_per_node=2, say=lines.append)
    result = launch(job)
    assert result.ok, result.error
    assert [o.exit_status for o in result.nodes] == [0, 0]
    text = "\n".join(lines)
    hashes = dict(re.findall(r"STATE_SHA256 rank=(\d) world=4 ([0-9a-f]{64})", text))
    assert sorted(hashes) == ["0", "1", "2", "3"] and len(set(hashes.values())) == 1
    # Shown live with node/rank prefixes (the prefix's rank is the line's own), and kept per node.
    prefixed = re.findall(r"^(n[01])/(\d): rank (\d) epoch 0 loss", text, re.M)
    assert len(prefixed) == 4 and all(a == b for _, a, b in prefixed)
    assert {node for node, _, _ in prefixed} == {"n0", "n1"}
    assert "STATE_SHA256" in (tmp_path / "run" / "logs" / "n0.log").read_text() + (tmp_path / "run" / "logs" / "n1.log").read_text()
    # torchrun's own per-rank logs went to the node's run dir, not /tmp.
    assert list((tmp_path / "w0" / "runs" / "run" / "logs" / "torchelastic").iterdir())
    assert tagged_processes(result.rdzv_id) == []
    # A script without the session API writes no report: nothing fetched, nothing remarked on.
    assert result.fetched == [] and "could not fetch" not in text


def test_silent_run_is_stopped_by_the_watchdog(tmp_path):
    job = script_job(local_cluster(tmp_path), ["sleep", "600"], sync=str(SCRIPTS), run_dir=str(tmp_path / "run"),
                     say=lambda line: None)
    job.silence_limits_s = (6.0, 6.0)
    result = launch(job)
    assert not result.ok and result.exit_status == 1
    assert "no node printed anything" in result.error
    assert tagged_processes(result.rdzv_id) == []
    assert result.wall_seconds < 60


def test_a_node_without_its_interpreter_fails_the_launch_naming_it(tmp_path):
    good = Node(name="n0", host="127.0.0.1", local=True, python=sys.executable, workdir=str(tmp_path / "w0"))
    bad = Node(name="n1", host="127.0.0.1", local=True, python="/nonexistent/python3", workdir=str(tmp_path / "w1"))
    job = script_job(Cluster(nodes=(good, bad), head="n0"), ["python", "ddp_tutorial.py"], sync=str(SCRIPTS),
                     run_dir=str(tmp_path / "run"), say=lambda line: None)
    result = launch(job)
    assert result.exit_status == 1
    assert result.error.startswith("node n1 failed (exit status 127): ") and "/nonexistent/python3" in result.error
    assert result.wall_seconds < 60  # n0 waiting in the rendezvous was stopped, not waited for
    assert tagged_processes(result.rdzv_id) == []
