"""The quorum engine (`strategy.quorum`: DiLoCo on torchft's Manager) with the session API, on local
processes: one replica group per process (tests/scripts/quorum_replica.py), a real lighthouse
(`launch/lighthouse.py`), faults injected with SIGKILL.

- A replica killed mid-run: the survivors' next step starts within a few seconds (their
  metrics' step times), they are never restarted (same processes, steps continuous), every
  outer sync's weights hash alike on every replica that logged it, and the killed one, started
  again, heals from a peer, joins at a sync and ends with the same weights as the others.
- A relaunch from checkpoints (what the launcher does when the lighthouse dies): every replica
  resumes from its own, one starts a round late, and all end aligned: every outer step logged
  at one step with one hash, no sync lost, the late one healed to its peers' place.
- The lighthouse killed: the round in progress ends, the next quorum fails within the replicas'
  quorum time-out with one line naming the lighthouse, and they exit non-zero (the relaunch
  path's cue); no hang.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import pytest

from vpscluster.errors import UserError
from vpscluster.launch.lighthouse import start_lighthouse
from vpscluster.train.strategies.diloco import parse_sync_hash

SCRIPT = Path(__file__).parent / "scripts" / "quorum_replica.py"
SRC = str(Path(__file__).resolve().parents[1] / "src")
H = 5
STEP_S = 0.05
HEARTBEAT_MS = 2000
QUORUM_TIMEOUT_S = 8  # the script's strategy.quorum_timeout_s


class Replicas:
    """Replica-group processes of one run, each with its run dir and output files under `tmp`."""

    def __init__(self, tmp: Path, lighthouse: str, count: int, steps: int, step_s: float = STEP_S) -> None:
        self.tmp, self.lighthouse, self.count, self.steps, self.step_s = tmp, lighthouse, count, steps, step_s
        self.procs: dict[int, subprocess.Popen] = {}

    def start(self, i: int, *extra: str) -> subprocess.Popen:
        """Replica group i; `extra`: the script's optional arguments (CHECKPOINT_EVERY [resume])."""
        env = {**os.environ, "TORCHFT_LIGHTHOUSE": self.lighthouse, "VPSC_REPLICA_GROUP": f"{i}/{self.count}",
               "PYTHONPATH": SRC, "PYTHONUNBUFFERED": "1"}
        with open(self.tmp / f"out{i}", "a") as out, open(self.tmp / f"err{i}", "a") as err:
            self.procs[i] = subprocess.Popen(
                [sys.executable, str(SCRIPT), str(self.tmp / f"r{i}"), str(self.steps), str(H), "int8", str(self.step_s), *extra],
                stdout=out, stderr=err, stdin=subprocess.DEVNULL, env=env)
        return self.procs[i]

    def metrics(self, i: int) -> list[dict]:
        path = self.tmp / f"r{i}" / "metrics.jsonl"
        return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.is_file() else []

    def wait_for_step(self, i: int, step: int, timeout_s: float = 60) -> None:
        deadline = time.monotonic() + timeout_s
        while not any(m["step"] >= step for m in self.metrics(i)):
            assert self.procs[i].poll() is None, f"replica {i} exited early:\n{self.stderr(i)}"
            assert time.monotonic() < deadline, f"replica {i} did not reach step {step} in {timeout_s} s"
            time.sleep(0.05)

    def wait_all(self, timeout_s: float) -> dict[int, int]:
        deadline = time.monotonic() + timeout_s
        codes = {}
        for i, p in self.procs.items():
            try:
                codes[i] = p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                codes[i] = None  # a hang: the assertion that follows names it
        return codes

    def stop_all(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)

    def stdout(self, i: int) -> str:
        return (self.tmp / f"out{i}").read_text()

    def stderr(self, i: int) -> str:
        return (self.tmp / f"err{i}").read_text()[-3000:]

    def sync_lines(self, i: int) -> list[dict]:
        return [s for s in map(parse_sync_hash, self.stdout(i).splitlines()) if s]

    def reports(self, i: int) -> list[dict]:
        return [json.loads(x)["report"] for x in self.stdout(i).splitlines() if x.startswith('{"report"')]


@pytest.fixture
def lighthouse(tmp_path):
    lh = start_lighthouse("127.0.0.1", min_replicas=2, heartbeat_timeout_ms=HEARTBEAT_MS, log=tmp_path / "lighthouse.log")
    yield lh
    lh.stop()


def test_a_killed_replica_costs_the_survivors_seconds_and_heals_back(tmp_path, lighthouse):
    run = Replicas(tmp_path, lighthouse.address, count=3, steps=100)
    survivors, victim = (0, 1), 2
    try:
        for i in range(3):
            run.start(i)
        run.wait_for_step(victim, 3 * H + 2)  # mid-round, after a few syncs of all three
        before = {i: run.procs[i].pid for i in survivors}
        run.procs[victim].send_signal(signal.SIGKILL)
        run.procs[victim].wait(timeout=10)
        killed_at = max(m["step"] for m in run.metrics(0))
        run.wait_for_step(0, killed_at + 2 * H)  # the survivors train on without it
        run.start(victim)
        codes = run.wait_all(timeout_s=60)
    finally:
        run.stop_all()
    assert codes == {0: 0, 1: 0, 2: 0}, [run.stderr(i) for i in range(3)]
    assert {i: run.procs[i].pid for i in survivors} == before  # never restarted

    # The survivors' steps: continuous (no step run twice: nothing reloaded), and the longest one
    # after the kill (a failed reduction, then a quorum without the dead one) took a few seconds.
    pauses = {}
    for i in survivors:
        m = run.metrics(i)
        steps = [x["step"] for x in m]
        assert steps == list(range(steps[0], 101)), f"replica {i}'s steps are not continuous: {steps}"
        median = sorted(x["step_seconds"] for x in m)[len(m) // 2]
        pauses[i] = max(x["step_seconds"] for x in m if x["step"] > killed_at - H)
        assert pauses[i] < 6.0 and median < 0.5, (pauses, median)
    print(f"survivors' longest step after the kill: {pauses} s (lighthouse heartbeat time-out {HEARTBEAT_MS} ms)")

    # Every outer step's weights alike on every replica that logged it; some without the victim.
    by_outer: dict[int, set[str]] = defaultdict(set)
    worlds: dict[int, set[int]] = defaultdict(set)
    for i in range(3):
        for s in run.sync_lines(i):
            by_outer[s["outer_step"]].add(s["sha256"])
            worlds[s["outer_step"]].add(s["world_size"])
    assert by_outer and all(len(h) == 1 for h in by_outer.values()), by_outer
    assert any(w == {2} for w in worlds.values()), worlds  # syncs of the survivors alone
    # The returning replica: healed to the others' place, then in their syncs to the end.
    joined = [json.loads(x)["joined_at_step"] for x in run.stdout(victim).splitlines() if "joined_at_step" in x]
    assert len(joined) == 2 and joined[1] > killed_at, joined
    back = [s for s in run.sync_lines(victim) if s["step"] > joined[1]]
    assert back and back[-1]["step"] == 100 and back[-1]["world_size"] == 3
    final = [run.reports(i)[-1] for i in range(3)]
    assert len({r["model_sha256"] for r in final}) == 1 and {r["steps"] for r in final} == {100}
    assert final[victim]["strategy_details"]["heals"] >= 1


def test_a_relaunch_with_a_late_replica_resumes_aligned(tmp_path, lighthouse):
    """Every replica group resumes from its own checkpoint (step 10), as after the launcher's
    relaunch: replica 1 has none left and heals from 0 at their first quorum; the third starts
    once the other two made their first sync. It must heal from them at their next quorum and
    train on aligned: every outer step logged at one step with one hash, no sync lost. Before
    the fix (issue #34) it joined that quorum with the fresh model, healed, then loaded its own
    checkpoint over the heal and asked a quorum of its own: the others' next sync, counting it,
    timed out without it. And a replica healing from a resumed peer's first quorum must take
    the peer's resumed step, not step 0."""
    steps, every = 60, 10
    first = Replicas(tmp_path, lighthouse.address, count=3, steps=every)
    try:
        for i in range(3):
            first.start(i, str(every))
        assert first.wait_all(timeout_s=60) == {0: 0, 1: 0, 2: 0}, [first.stderr(i) for i in range(3)]
    finally:
        first.stop_all()
    synced = [len(first.sync_lines(i)) for i in range(3)]  # the output files go on in the relaunch
    shutil.rmtree(tmp_path / "r1" / "checkpoints")  # replica 1 lost its own: it heals from 0, to 0's place
    run = Replicas(tmp_path, lighthouse.address, count=3, steps=steps, step_s=0.2)  # 9 s of steps left at step 15
    try:
        for i in (0, 1):
            run.start(i, str(every), "resume")
        deadline = time.monotonic() + 60
        while len(run.sync_lines(0)) == synced[0]:  # their first sync after the relaunch
            assert time.monotonic() < deadline and all(run.procs[i].poll() is None for i in (0, 1)), \
                [run.stderr(i) for i in (0, 1)]
            time.sleep(0.05)
        run.start(2, str(every), "resume")
        codes = run.wait_all(timeout_s=90)
    finally:
        run.stop_all()
    assert codes == {0: 0, 1: 0, 2: 0}, [run.stderr(i) for i in range(3)]
    by_outer: dict[int, set[tuple[int, str]]] = defaultdict(set)
    for i in range(3):
        for s in run.sync_lines(i):
            by_outer[s["outer_step"]].add((s["step"], s["sha256"]))
    assert sorted(by_outer) == list(range(1, steps // H + 1)), sorted(by_outer)
    assert all(len(v) == 1 for v in by_outer.values()), dict(by_outer)  # one step, one hash per outer step
    final = [run.reports(i)[-1] for i in range(3)]
    assert {r["steps"] for r in final} == {steps} and len({r["model_sha256"] for r in final}) == 1, final
    assert [r["strategy_details"]["syncs_failed"] for r in final] == [0, 0, 0], final  # no round lost to the join
    late = run.sync_lines(2)[synced[2]:]
    assert final[2]["strategy_details"]["heals"] >= 1 and late[0]["step"] > 15, late  # healed past their first sync
    assert final[1]["strategy_details"]["heals"] >= 1, final[1]


def test_the_lighthouse_killed_ends_the_replicas_with_one_line_and_no_hang(tmp_path, lighthouse):
    run = Replicas(tmp_path, lighthouse.address, count=2, steps=10_000)
    try:
        for i in range(2):
            run.start(i)
        run.wait_for_step(0, 2 * H + 1)
        lighthouse.proc.send_signal(signal.SIGKILL)
        lighthouse.proc.wait(timeout=10)
        t0 = time.monotonic()
        codes = run.wait_all(timeout_s=QUORUM_TIMEOUT_S + 20)
        took = time.monotonic() - t0
    finally:
        run.stop_all()
    assert all(c not in (0, None) for c in codes.values()), codes  # failed, and nobody hung
    for i in range(2):
        lines = [x for x in run.stderr(i).splitlines() if "QuorumLost" in x]
        assert lines and re.search(r"no quorum of 2 replica groups within 8 s at the lighthouse http://127\.0\.0\.1:\d+",
                                   lines[-1]), run.stderr(i)
    assert took < QUORUM_TIMEOUT_S + 15
    print(f"replicas ended {took:.1f} s after the lighthouse was killed")


def test_the_lighthouse_that_cannot_start_says_so_in_one_line():
    with pytest.raises(UserError, match=r"the torchft lighthouse on 192\.0\.2\.1:\d+ exited .*check that the address"):
        start_lighthouse("192.0.2.1", timeout_s=10)  # TEST-NET-1: not this machine's


def test_settings_the_quorum_engine_cannot_take_are_refused_in_one_line(monkeypatch):
    from vpscluster.session.config import SessionConfig
    from vpscluster.config import build
    from vpscluster.train.strategies import get_strategy_class
    from vpscluster.train.strategies.base import DistContext
    from vpscluster.train.config import StrategyConfig, TrainConfig

    with pytest.raises(UserError, match="quorum needs --strategy diloco"):
        build(SessionConfig, {"strategy": {"name": "ddp", "quorum": True}}, "test")
    with pytest.raises(UserError, match="leave fragments at 1"):
        StrategyConfig(name="diloco", quorum=True, wire_dtype="sparse4")
    with pytest.raises(UserError, match="--quorum trains one replica group per node of a cluster file"):
        TrainConfig(strategy=StrategyConfig(name="diloco", quorum=True))
    with pytest.raises(UserError, match="--quorum runs one rank per node"):
        TrainConfig(cluster="c.yaml", nproc_per_node=2, strategy=StrategyConfig(name="diloco", quorum=True))
    with pytest.raises(UserError, match="has no quorum engine yet"):
        get_strategy_class("ddp", quorum=True)
    cls = get_strategy_class("diloco", quorum=True)
    monkeypatch.delenv("TORCHFT_LIGHTHOUSE", raising=False)
    with pytest.raises(UserError, match="TORCHFT_LIGHTHOUSE"):
        cls(StrategyConfig(name="diloco", quorum=True), DistContext())
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", "http://127.0.0.1:1")
    monkeypatch.setenv("VPSC_REPLICA_GROUP", "3/3")
    with pytest.raises(UserError, match="INDEX/COUNT"):
        cls(StrategyConfig(name="diloco", quorum=True), DistContext())
    with pytest.raises(UserError, match="one process per replica group"):
        cls(StrategyConfig(name="diloco", quorum=True), DistContext(world_size=2))
