"""Recovery over the WireGuard overlay: relaunches on the survivors run encrypted.

Three own-root sandbox nodes get the overlay (`provision` with the overlay role, as
test_overlay_sandbox.py does) and train DiLoCo.

- node-3 is killed mid-run, in a run started with no recovery flag (survival is the default:
  at least 2 of the 3 nodes must remain) (`sandbox fault kill`: every process but the sshd daemon, as a VPS
  reboot would leave it); its wireguard-go dies with the rest, taking vpsc0 along. It still
  answers over SSH. Whether the failed launch's teardown reaches it depends on timing: if it
  does, the relaunch takes it along and its pre-flight fails ("the overlay is not up there"); if
  not, it is out at once and the rejoin watcher sees it answer without its overlay. Either way
  it is left out, and the survivors relaunch over their overlay addresses and finish.
- node-2's overlay interface is deleted mid-run (`--max-restarts 2 --min-nodes 2` given) and its ranks killed: every node still answers,
  so the relaunch takes all three and node-2 fails its pre-flight; it is left out (a second restart) and the
  run finishes on node-1 and node-3, over the overlay.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest

from sandbox_fixtures import TEST_PREFIX, cmdline, sandbox_unavailable_reason, ssh_run
from test_overlay_sandbox import lend_host_python

pytestmark = [pytest.mark.sandbox, pytest.mark.slow]

CONFIG = """\
batch_size: 2
threads_per_rank: 1
checkpoint_every: 5
eval_every: 1000
eval_batches: 1
strategy: {sync_every: 5, overlap_steps: 0, sync_timeout_s: 3, sync_retries: 1}
timeouts: {train_collective_s: 10, startup_collective_s: 60, rendezvous_s: 120, stop_grace_s: 10}
recovery: {rejoin_poll_s: 2}
"""
MAX_STEPS = 25
OVERLAY = {"node-1": "10.77.0.1", "node-2": "10.77.0.2", "node-3": "10.77.0.3"}


@pytest.fixture(scope="module")
def overlaid(tmp_path_factory):
    from vpscluster.cluster import sandbox
    from vpscluster.cluster.inventory import load_cluster
    from vpscluster.cluster.sandbox import rootfs
    from vpscluster.provision import provision

    why = sandbox_unavailable_reason() or rootfs.supported()
    missing = [t for t in ("wg", "wireguard-go", "nft") if not shutil.which(t)]
    if why or missing:
        pytest.skip(f"sandbox unavailable: {why or 'missing ' + ', '.join(missing)}")
    name = f"{TEST_PREFIX}rov-{secrets.token_hex(3)}"
    try:
        info = sandbox.up(name, nodes=3, bandwidth="1gbit", own_root=True)
        lend_host_python(info)
        prov = provision(load_cluster(info.cluster_file), roles=["overlay"])
        assert prov["ok"], prov
        assert prov["overlay"]["addresses"] == OVERLAY
        config = tmp_path_factory.mktemp("recovery-overlay") / "train.yaml"
        config.write_text(CONFIG)
        yield info, config
    finally:
        sandbox.down(name)


def train_through(info, config, run_dir, fault, recovery_flags=("--min-nodes", "2", "--max-restarts", "2")) -> tuple[dict, str]:
    """Train on the three nodes, call `fault()` after the first checkpoint; the report and what
    the launcher said (whitespace collapsed: the console wraps long lines)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "vpscluster", "train", "--cluster", info.cluster_file, "--config", str(config),
         "--preset", "tiny", "--strategy", "diloco", *recovery_flags,
         "--max-steps", str(MAX_STEPS), "--run-dir", str(run_dir), "--json"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stderr.readline, "")), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 240
        while not any('"event":"checkpoint"' in p.read_text(errors="replace")
                      for p in (run_dir / "logs").glob("node-*.log")):
            assert proc.poll() is None and time.monotonic() < deadline, "\n".join(lines[-30:])
            time.sleep(0.5)
        fault()
        proc.wait(timeout=400)
        out = proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=30)
    reader.join(timeout=10)
    assert proc.returncode == 0, "\n".join(lines[-40:])
    report = json.loads(out)
    print("recoveries:", json.dumps(report["recoveries"]))
    return report, " ".join(" ".join(lines).split())


def assert_finished_over_the_overlay(info, report, run_dir, survivors: list[str]) -> None:
    assert report["steps"] == MAX_STEPS and report["world_size"] == 2, report
    assert len({r["model_sha256"] for r in report["per_rank"]}) == 1, report["per_rank"]
    last = report["recoveries"][-1]
    assert last["kind"] == "restart" and last["nodes"] == survivors and "training_again_after_s" in last, last
    # The relaunch on the two bound everything to the overlay: rendezvous, advertised addresses, gloo.
    underlay = [n.address for n in info.nodes]
    for node in survivors:
        final = [line for line in (run_dir / "logs" / f"{node}.log").read_text().splitlines()
                 if "--rdzv-endpoint" in line][-1]
        assert f"--rdzv-endpoint {OVERLAY[survivors[0]]}:" in final and f"--local-addr {OVERLAY[node]}" in final, final
        assert "GLOO_SOCKET_IFNAME=vpsc0" in final and "--nnodes 2 " in final, final
        assert not any(a in final for a in underlay), final
    assert report["rank0_node"] == survivors[0]


def test_a_killed_node_is_left_out_and_the_survivors_go_on_over_the_overlay(overlaid, tmp_path):
    from vpscluster.cluster.sandbox import faults

    info, config = overlaid

    def kill() -> None:
        faults.inject(info.name, "node-3", "kill")  # wireguard-go too: vpsc0 is gone
        assert "vpsc0" not in ssh_run(info, "node-3", "ip -o link").stdout

    run_dir = tmp_path / "run-kill"
    report, said = train_through(info, config, run_dir, kill, recovery_flags=())  # survival is the default
    assert "recovery: on (after a failure the run relaunches from the last checkpoint on the nodes that answer " \
        "while at least 2 of 3 nodes remain (half, rounded up; --min-nodes M sets it), up to 6 restarts; " \
        "--max-restarts 0 turns it off)" in said, said[:3000]
    assert_finished_over_the_overlay(info, report, run_dir, ["node-1", "node-2"])
    last = report["recoveries"][-1]
    assert last["out"] == ["node-3"], report["recoveries"]
    assert "node-3 answers again" not in said, said[-3000:]  # it answers, but without its overlay
    if len(report["recoveries"]) == 2:  # teardown reached node-3: the relaunch took it, its pre-flight failed
        assert last["failed_node"] == "node-3" and "the relaunch failed before training: node node-3: the overlay " \
            "is not up there (vpsc0 does not carry 10.77.0.3)" in last["error"], last
    else:  # teardown could not reach it (the kill was still going on): out from the first restart
        assert len(report["recoveries"]) == 1, report["recoveries"]


def test_a_node_failing_the_relaunch_pre_flight_is_left_out(overlaid, tmp_path):
    from vpscluster.cluster.inventory import load_cluster
    from vpscluster.provision import provision

    info, config = overlaid
    # Bring back what the kill before took (node-3's wireguard-go), as the user would.
    assert provision(load_cluster(info.cluster_file), roles=["overlay"])["ok"]

    def drop_overlay() -> None:  # and its ranks with it, so the launch fails at once
        from vpscluster.cluster.sandbox import faults

        assert ssh_run(info, "node-2", "ip link del vpsc0").returncode == 0
        ranks = [p for p in faults.node_pids(info, info.node("node-2")) if "vpscluster.train.worker" in cmdline(p)]
        assert ranks
        for pid in ranks:
            os.kill(pid, signal.SIGKILL)

    run_dir = tmp_path / "run-preflight"
    report, said = train_through(info, config, run_dir, drop_overlay)
    assert_finished_over_the_overlay(info, report, run_dir, ["node-1", "node-3"])
    first, second = report["recoveries"]
    assert first["nodes"] == ["node-1", "node-2", "node-3"] and first["out"] == [], first  # all answered
    assert second["failed_node"] == "node-2" and second["out"] == ["node-2"], second
    assert re.search(r"the relaunch failed before training: node node-2: the overlay is not up there \(vpsc0 does "
                     r"not carry 10\.77\.0\.2\).* relaunching on 2 nodes from the last checkpoint without node-2 "
                     r"\(restart 2 of 2\)", said), said[-3000:]
