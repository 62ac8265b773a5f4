"""torchft on gloo/CPU, checked before building on it (issue 13): a replica killed mid-run, then back.

    run_torchft(TorchftSettings(...), say=print) -> results document   (CLI: `vpscluster bench torchft`)

vpscluster's recovery today relaunches torchrun from the last checkpoint. torchft (PyTorch's
fault-tolerance library: per-step quorum, reconfigurable process groups, a Rust lighthouse) would
let the survivors go on at the next outer sync instead. This bench checks on this machine that
torchft does what a build on it would rely on: the lighthouse runs in this process; each replica
group is a local process (`vpscluster.bench.torchft_replica`: a torchft Manager over
ProcessGroupGloo and torchft's own DiLoCo). With `bandwidth` set, each replica runs on its own
sandbox node instead (its network namespace and CPU cgroup, links shaped to `bandwidth`, `cpu`
per node) and the lighthouse listens on the sandbox bridge. One replica is killed with SIGKILL at `kill_at_s` and
started again at `back_at_s`. Measured from the replicas' logs (one line per outer sync):

- every outer sync's weights hash alike on every replica that took part (mismatches must be 0);
- the survivors' pause at the kill: the longest gap between two of their syncs around it,
  against their median gap, and whether they ever stopped (they must not: no restart);
- the returning replica: seconds from its start to its first sync, whether it healed (took
  the others' step and weights) and whether its weights equal theirs from then on.

Needs torchft (`pip install 'vpscluster[ft]'`). Results: `out` (default
bench/results/torchft-<UTC time>/): results.json, table.md, syncs.jsonl, each replica's output.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from vpscluster.bench import table


@dataclass
class TorchftSettings:
    replicas: int = 3
    sync_every: int = 5
    step_s: float = 0.1
    steps: int = 110  # outer syncs each replica runs
    victim: int = 2
    kill_at_s: float = 25.0
    back_at_s: float = 45.0
    timeout_s: float = 300.0
    hidden: int = 256  # the MLP's width: 64 -> hidden -> 8 (hidden 4096: 0.3M parameters, 1.2 MB per sync)
    bandwidth: str = ""  # "" = local processes; else a sandbox node per replica with links of this rate
    cpu: str = ""  # the sandbox nodes' CPU share ("" = not limited)
    name: str = "torchft-bench"  # the sandbox's name
    out: str | None = None


def run_torchft(settings: TorchftSettings, say: Callable[[str], None] = lambda line: None) -> dict[str, Any]:
    from vpscluster.errors import UserError

    s = settings
    if s.replicas < 3 or not 0 <= s.victim < s.replicas or not 0 < s.kill_at_s < s.back_at_s:
        raise UserError("bench torchft: needs --replicas >= 3, 0 <= --victim < replicas and 0 < --kill-at-s < --back-at-s")
    os.environ.setdefault("RUST_LOG", "warn")  # the lighthouse logs every quorum status at info, twice a second
    try:
        from torchft._torchft import LighthouseServer
    except ImportError:
        raise UserError("bench torchft: torchft is not installed; pip install 'vpscluster[ft]' (torchft 0.2.0)") from None
    out = Path(s.out or Path("bench") / "results" / time.strftime("torchft-%Y%m%d-%H%M%S", time.gmtime())).resolve()
    out.mkdir(parents=True, exist_ok=True)
    log = out / "syncs.jsonl"
    log.unlink(missing_ok=True)
    box = None
    if s.bandwidth:
        from vpscluster.cluster import sandbox

        box = sandbox.up(s.name, nodes=s.replicas, bandwidth=s.bandwidth, cpu=s.cpu or None,
                         progress=lambda m: say(f"  {m}"))
    host = box.gateway if box else "127.0.0.1"  # the lighthouse's side of the sandbox bridge
    try:
        lighthouse = LighthouseServer(bind=f"{host}:0", min_replicas=2, join_timeout_ms=1000)
    except BaseException:
        if box:
            sandbox.down(s.name)
        raise
    # address() names this machine's hostname, which a node may not resolve: the bound address instead
    addr = f"http://{host}:{lighthouse.address().rsplit(':', 1)[1]}"
    where = f"sandbox {s.name}: a node per replica, {s.bandwidth} links" if box else "local processes"
    say(f"lighthouse {addr}; {s.replicas} replicas ({where}), DiLoCo H={s.sync_every}, {s.steps} outer syncs each; "
        f"replica {s.victim} killed at {s.kill_at_s:g} s, back at {s.back_at_s:g} s")
    procs: dict[int, subprocess.Popen] = {}
    events: dict[str, float] = {}

    def start(r: int) -> subprocess.Popen:
        argv = [sys.executable, "-m", "vpscluster.bench.torchft_replica", str(r), addr, str(s.steps), str(s.sync_every),
                str(s.step_s), str(log), str(s.hidden)]
        if box:
            from vpscluster.cluster.sandbox import cgroup

            node = box.nodes[r]
            argv = [*argv, node.address]
            argv = cgroup.enter_argv(node.cgroup, node.namespace, argv) if node.cgroup else \
                ["ip", "netns", "exec", node.namespace, *argv]
        with open(out / f"replica-{r}.out", "a") as f:
            return subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env={**os.environ, "PYTHONUNBUFFERED": "1",
                                         **({"GLOO_SOCKET_IFNAME": "eth0"} if box else {})})  # the node's link, not lo

    t0 = time.time()
    try:
        procs = {r: start(r) for r in range(s.replicas)}
        _sleep_until(t0 + s.kill_at_s)
        procs[s.victim].kill()
        procs[s.victim].wait(timeout=30)
        events["killed"] = time.time()
        say(f"  {events['killed'] - t0:.1f} s: replica {s.victim} killed (SIGKILL)")
        _sleep_until(t0 + s.back_at_s)
        procs[s.victim] = start(s.victim)
        events["restarted"] = time.time()
        say(f"  {events['restarted'] - t0:.1f} s: replica {s.victim} started again")
        deadline = t0 + s.timeout_s
        codes = {}
        for r, p in procs.items():
            try:
                codes[r] = p.wait(timeout=max(1.0, deadline - time.time()))
            except subprocess.TimeoutExpired:
                codes[r] = "timeout"
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait(timeout=30)
        lighthouse.shutdown()
        if box:
            sandbox.down(s.name)
    lines = [json.loads(x) for x in log.read_text().splitlines()] if log.is_file() else []
    doc = {"command": "vpscluster bench torchft " + " ".join(
        f"--{k.replace('_', '-')} {getattr(s, k)}" for k in ("replicas", "sync_every", "step_s", "steps", "victim",
                                                              "kill_at_s", "back_at_s", "hidden", "bandwidth", "cpu")),
           "torchft": _version("torchft"), "torch": _version("torch"),
           "exit_codes": {str(r): c for r, c in codes.items()},
           "summary": summarize(lines, s.victim, s.replicas, events["killed"], events["restarted"]),
           "results_dir": str(out)}
    (out / "results.json").write_text(json.dumps(doc, indent=1))
    (out / "table.md").write_text(markdown(doc) + "\n")
    return doc


def summarize(lines: list[dict], victim: int, replicas: int, killed: float, restarted: float) -> dict[str, Any]:
    """The checks of the module's docstring, from the replicas' sync lines."""
    by_step: dict[int, dict[str, dict]] = defaultdict(dict)
    for ln in lines:
        by_step[ln["step"]][str(ln["replica"])] = ln  # a replica's latest line at that step
    mismatched = [st for st, reps in by_step.items() if len({x["hash"] for x in reps.values()}) > 1]
    survivors = [str(r) for r in range(replicas) if r != victim]
    surv_t = sorted({round(min(by_step[st][r]["t"] for r in survivors), 3) for st in by_step
                     if all(r in by_step[st] for r in survivors)})
    gaps = [b - a for a, b in zip(surv_t, surv_t[1:])]
    around = [b - a for a, b in zip(surv_t, surv_t[1:]) if b >= killed and a <= killed + 30]
    back = sorted((x for x in lines if str(x["replica"]) == str(victim) and x["t"] >= restarted), key=lambda x: x["t"])
    first = back[0] if back else None
    rejoined_equal = bool(back) and all(
        len({y["hash"] for y in by_step[x["step"]].values()}) == 1 and len(by_step[x["step"]]) == replicas for x in back)
    fewer = [st for st, reps in by_step.items() if min(x["participants"] for x in reps.values()) < replicas]
    return {
        "outer_syncs": len(by_step),
        "mismatched_syncs": len(mismatched),
        "syncs_with_fewer_replicas": len(fewer),
        "survivor_median_gap_s": statistics.median(gaps) if gaps else None,
        "survivor_pause_at_kill_s": max(around) if around else None,
        "victim_first_sync_after_start_s": first["t"] - restarted if first else None,
        "victim_healed_to_step": first["step"] if first else None,
        "victim_equal_after_rejoin": rejoined_equal,
        "participants_min": min((x["participants"] for x in lines), default=None),
    }


COLUMNS = [("outer_syncs", "outer syncs", "{}"), ("mismatched_syncs", "syncs with differing weights", "{}"),
           ("syncs_with_fewer_replicas", "syncs without the killed replica", "{}"),
           ("survivor_median_gap_s", "survivors' median gap s", "{:.2f}"),
           ("survivor_pause_at_kill_s", "survivors' longest gap at the kill s", "{:.2f}"),
           ("victim_first_sync_after_start_s", "returning replica: first sync after start s", "{:.2f}"),
           ("victim_healed_to_step", "healed to step", "{}"),
           ("victim_equal_after_rejoin", "identical after rejoin", "{}")]


def markdown(doc: dict[str, Any]) -> str:
    return (table.markdown([doc["summary"]], COLUMNS)
            + f"\n\ntorchft {doc['torchft']}, torch {doc['torch']}; exit codes {doc['exit_codes']}")


def _sleep_until(when: float) -> None:
    while (left := when - time.time()) > 0:
        time.sleep(min(left, 1.0))


def _version(dist: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None
