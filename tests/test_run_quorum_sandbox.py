"""`run --quorum` on three sandbox nodes: a user's session script (tests/scripts/session_loop.py,
one thread, a small MLP) on torchft's quorum, one node's processes killed mid-run, the others
finish without a relaunch.

`vpscluster run --cluster FILE --strategy diloco --quorum -- python session_loop.py` goes through
`train --quorum`'s launch: torchft's lighthouse on the head (node-1), a torchrun of its own on
every node (one replica group each), and the script's `session.start()` gets the quorum engine
from the session settings. Once node-3 took part in an outer sync, mid-round, every process of
node-3 gets SIGKILL (`sandbox fault kill`; its sshd stays, so it answers SSH again and the
launcher may start its replica group again, healed from a peer). Checked from outside:

- the launcher's lines: node-3 failed and the others train on; no relaunch; the run ends with
  exit status 0 and its report lists the loss as a `quorum` recovery, with the step it came
  after and the seconds to the survivors' next step (from rank 0's `step` events);
- the script's own step lines in node-1's log go on from the kill to the last step, one by one
  (nothing redone: no checkpoint was reloaded);
- every outer sync's weights hash alike on every replica that logged it, the syncs after the
  kill are the survivors' (node-3's restarted replica, where it joined in time, among them), and
  node-1's and node-2's final weights are the same.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from sandbox_fixtures import SandboxFactory
from test_quorum_sandbox import StepWatch
from vpscluster.launch.logs import diloco_sync_hashes

pytestmark = [pytest.mark.sandbox, pytest.mark.slow]

SCRIPT = Path(__file__).parent / "scripts" / "session_loop.py"
STEPS = 40  # H = 5: eight outer syncs
STEP_S = 0.15  # a step's stand-in compute: the run lasts long enough to kill node-3 mid-round
KILL_AFTER = 7  # at the earliest: node-3 took part in the sync of step 5, and the step is mid-round
STEP_LINE = re.compile(r'node-1/0 stdout: \{"step": (\d+)\}')
REPORT_LINE = re.compile(r'(node-\d)/0 stdout: (\{"report": .*\})')


@pytest.fixture(scope="module")
def sandbox():
    factory = SandboxFactory(kind="rq-")
    try:
        yield factory(nodes=3, bandwidth="1gbit")
    finally:
        factory.close()


def test_run_quorum_a_killed_node_costs_no_relaunch(sandbox, tmp_path):
    from vpscluster.cluster.sandbox import faults

    app = tmp_path / "app"  # the user's folder: synced to every node and run from there
    app.mkdir()
    shutil.copy(SCRIPT, app / SCRIPT.name)
    run_dir = tmp_path / "run"
    started = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-m", "vpscluster", "run", "--cluster", str(sandbox.cluster_file), "--strategy", "diloco",
         "--quorum", "--sync-every", "5", "--wire-dtype", "fp32", "--run-dir", str(run_dir), "--json", "--",
         "python", SCRIPT.name, str(STEPS), str(STEP_S)],
        cwd=app, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(iter(proc.stderr.readline, "")), daemon=True).start()
    watch = StepWatch(run_dir / "logs" / "node-1.log", STEP_LINE)
    node3_log = run_dir / "logs" / "node-3.log"
    try:
        deadline = time.monotonic() + 120
        while (watch.last_step() < KILL_AFTER or watch.last_step() % 5 in (0, 4)
               or not node3_log.exists() or "world 3 sha256" not in node3_log.read_text()):
            assert proc.poll() is None and time.monotonic() < deadline, "\n".join(lines[-40:])
            time.sleep(0.05)
        faults.inject(sandbox.name, "node-3", "kill")
        killed, kill_step = time.monotonic(), watch.last_step()
        proc.wait(timeout=120)
        out = proc.stdout.read()
    finally:
        watch.stop()
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=30)
        faults.clear(sandbox.name)
    text = "\n".join(lines)
    print(f"run --quorum: node-3 killed after step {kill_step}, {killed - started:.1f} s in; "
          f"the run ended {time.monotonic() - killed:.1f} s later")
    assert proc.returncode == 0, "\n".join(lines[-40:])
    assert "relaunching" not in text, text[-3000:]
    assert "node node-3 failed" in text and "train on without it (the quorum leaves it out)" in text, text[-3000:]
    result = json.loads(out)
    assert result["ok"] and result["lost_nodes"] == ["node-3"], result

    # The launcher's record: one quorum loss, no restart (node-3 may be back: a quorum_rejoin).
    report = json.loads((run_dir / "report.json").read_text())
    kinds = [r["kind"] for r in report["recoveries"]]
    assert kinds[0] == "quorum" and set(kinds) <= {"quorum", "quorum_rejoin"}, report["recoveries"]
    lost = report["recoveries"][0]
    assert lost["out"] == ["node-3"] and lost["nodes"] == ["node-1", "node-2"], lost
    # From rank 0's step events (the session announces its step under `vpscluster run`): where the
    # run was when node-3 went, and how soon the survivors stepped again.
    assert KILL_AFTER <= lost["after_step"] <= STEPS and lost["training_again_after_s"] < 8.0, lost

    # The script's steps on node-1 from before the kill to the last one, one by one: nothing redone.
    steps = [s for t, s in watch.seen if t >= killed - 1.0]
    assert steps and steps == list(range(steps[0], STEPS + 1)), steps
    gaps = [b[0] - a[0] for a, b in zip(watch.seen, watch.seen[1:]) if a[0] >= killed - 1.0]
    print(f"run --quorum: longest gap between node-1's step lines after the kill: {max(gaps):.2f} s; the launcher "
          f"saw node-3 go after step {lost['after_step']} and the next step {lost['training_again_after_s']} s later")

    # Every outer sync agreed; those after the kill are the survivors' (with node-3 where it healed in time).
    syncs = diloco_sync_hashes(run_dir / "logs")
    assert syncs and all(len(by_hash) == 1 for by_hash in syncs.values()), syncs
    # (node-3's first start may miss the first quorum on a loaded machine; it took part before the kill)
    before = {k: set().union(*syncs[k].values()) for k in syncs if k[3] <= kill_step}
    assert {"node-1/0", "node-2/0", "node-3/0"} in before.values(), sorted(syncs)
    after = sorted(k for k in syncs if k[3] > kill_step)
    assert after and after[-1][3] == STEPS, sorted(syncs)
    for key in after:
        ranks = set().union(*syncs[key].values())
        assert {"node-1/0", "node-2/0"} <= ranks and (key[0] == 2) == (ranks == {"node-1/0", "node-2/0"}), (key, ranks)
    assert any(k[0] == 2 for k in after), sorted(syncs)  # at least one sync the survivors made alone

    if "quorum_rejoin" in kinds:  # node-3 answered again: started again, it healed from a peer
        assert "replica group 2: healed from a peer" in node3_log.read_text(), node3_log.read_text()[-3000:]

    # The survivors' final weights: the same, after every step (node-3's too, where it rejoined and finished).
    finals = {}
    for node in ("node-1", "node-2", "node-3"):
        log = (run_dir / "logs" / f"{node}.log").read_text()
        docs = [json.loads(m.group(2)) for m in map(REPORT_LINE.search, log.splitlines()) if m]
        assert len(docs) == 1 or (node == "node-3" and not docs), (node, docs)  # node-3's first run was killed
        finals.update({node: doc["report"] for doc in docs})
    assert {f["steps"] for f in finals.values()} == {STEPS} and len({f["model_sha256"] for f in finals.values()}) == 1, finals
    print(f"run --quorum: final weights alike on {', '.join(sorted(finals))}; recoveries {kinds}")
