"""The fault benchmark: a scripted schedule of faults during one training run, against a
fault-free run of the same length.

    run_faults(FaultSettings(...), say=print) -> results document   (CLI: `vpscluster bench faults`)

One sandbox of three nodes. For each strategy (diloco, ddp): a fault-free run of `max_steps`,
then the same run with `--max-restarts`/`--min-nodes 2` while this module injects, one after
the other once training has settled from the previous one (`gap_steps` steps apart):

    worker-kill   SIGKILL one training process on node-2 (its node stays up)
    link-5s       node-2's link down for 5 s (shorter than the time-out: must cost no restart)
    node-kill     every process of node-2 killed (a VPS rebooted; it answers SSH again at once)
    stop          node-3's processes SIGSTOPped for `stop_s` (longer than the time-out)
    link-long     node-3's link down for `link_long_s` (longer than the time-out), then back
    disk-full     node-2's disk filled just before a checkpoint, for `disk_full_s`
    throttle      node-3's link at 1 Mbit/s for `throttle_s`
    head-down     node-1 (the head: rank 0 and the rendezvous store) cut off for `head_down_s`
                  (not in the default schedule: the run moves its head to node-2)
    node-dead     node-3 cut off for good (a VPS that died and stays dead): the run must go on
                  and end on node-1 and node-2 (not in the default schedule; last if given;
                  the cut is lifted after the run, for the corrupt-checkpoint resume)

and after the run ends: the shard of the newest checkpoint on rank 0's node is corrupted and the
run resumed (`--resume`) for `gap_steps` more steps. The sandbox faults are `vpscluster sandbox fault`'s.

Per fault: the step it hit, restarts and rejoins it caused, detected after (s: from the
injection to the launcher seeing the failure), training again after (s: from that detection to
the next training step), rejoined after (s: from the node being reachable again to training on
all nodes), the longest pause between two steps, steps lost (steps redone after a restart), and
whether it hung (no step and no failure within `hang_s` of the fault's end). Per run: final
validation loss against the fault-free run at equal tokens, sync attempts/retries/failures,
checkpoint failures, and whether the newest committed checkpoint is intact on every node.
Results: `out` (default bench/results/faults-<time>/): results.json, table.md, every run's files.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from vpscluster.bench import table
from vpscluster.bench.run_events import RunEvents
from vpscluster.bench.wan import _cli, _machine, evals_from_metrics, loss_at_tokens
from vpscluster.train.strategies import STRATEGIES, costs_for

SCHEDULE = ("worker-kill", "link-5s", "node-kill", "stop", "link-long", "disk-full", "throttle")
KNOWN = (*SCHEDULE, "head-down", "node-dead")
DEAD_S = 24 * 3600.0  # "for good": longer than any run; cleared when the run has ended


@dataclass
class FaultSettings:
    strategies: str = "diloco,ddp"
    faults: str = ",".join(SCHEDULE)
    bandwidth: str = "100mbit"
    preset: str = "tiny"
    gap_steps: int = 10  # steps of undisturbed training between two faults
    checkpoint_every: int = 5  # DiLoCo: also its sync_every (a checkpoint at each outer sync)
    timeout_s: float = 10.0  # collective/sync time-out (the seed practice: 10 s, then retry)
    stop_s: float = 30.0
    link_long_s: float = 40.0
    head_down_s: float = 90.0
    disk_full_s: float = 8.0
    throttle_s: float = 60.0
    hang_s: float = 240.0  # no step and no failure this long after a fault ended: a hang
    name: str = "faults-bench"
    out: str | None = None


def run_faults(settings: FaultSettings, say: Callable[[str], None] = lambda line: None) -> dict[str, Any]:
    from vpscluster.cluster import sandbox
    from vpscluster.errors import RemoteError, UserError

    s = settings
    strategies = [v.strip() for v in s.strategies.split(",") if v.strip()]
    if not strategies or any(v not in STRATEGIES for v in strategies):
        raise UserError(f"--strategies: choose from {', '.join(STRATEGIES)} (got {s.strategies!r})")
    faults = [v.strip() for v in s.faults.split(",") if v.strip()]
    if any(f not in KNOWN for f in faults):
        raise UserError(f"--faults: choose from {', '.join(KNOWN)} (got {s.faults!r})")
    if "node-dead" in faults[:-1]:
        raise UserError("--faults: node-dead must come last (nothing after it has three nodes to hit)")
    if s.gap_steps < s.checkpoint_every or s.checkpoint_every < 1:
        raise UserError("--gap-steps must be at least --checkpoint-every (>= 1): each fault needs a checkpoint before it")
    max_steps = s.gap_steps * (len(faults) + 4)  # room for steps redone and trained while a fault settles
    max_steps += -max_steps % 10  # an evaluation at the last step
    out = Path(s.out or Path("bench") / "results" / time.strftime("faults-%Y%m%d-%H%M%S", time.gmtime())).resolve()
    out.mkdir(parents=True, exist_ok=True)
    say(f"sandbox {s.name}: 3 nodes x {s.bandwidth}; {max_steps} steps per run; faults: {', '.join(faults)}")
    info = sandbox.up(s.name, nodes=3, bandwidth=s.bandwidth, progress=lambda m: say(f"  {m}"))
    runs: dict[str, dict[str, Any]] = {}
    try:
        for strategy in strategies:
            config = out / f"{strategy}.yaml"
            config.write_text(_config(s, strategy))
            say(f"{strategy}-fault-free: {max_steps} steps")
            free = out / f"{strategy}-fault-free"
            try:
                report = json.loads(_cli(_argv(s, info, config, max_steps, free), free.with_suffix(".log"), 1800).stdout)
                runs[f"{strategy}-fault-free"] = _summary(report, free)
                say(f"{strategy}-faults: {max_steps} steps, a fault every {s.gap_steps} steps")
                runs[f"{strategy}-faults"] = _faulty_run(s, info, config, max_steps, faults, out / f"{strategy}-faults", say)
            except (RemoteError, UserError, subprocess.TimeoutExpired, OSError, ValueError, KeyError) as e:
                runs.setdefault(f"{strategy}-faults", {"failed": str(e).splitlines()[0][:300], "faults": []})
                say(f"  {strategy} failed: {runs[f'{strategy}-faults']['failed']}")
    finally:
        try:
            from vpscluster.cluster.sandbox import faults as sandbox_faults

            sandbox_faults.clear(s.name)
        except Exception as e:  # noqa: BLE001 - the sandbox goes anyway
            say(f"warning: clearing faults: {e}")
        sandbox.down(s.name)
    rows = fault_rows(runs) + run_rows(runs)
    doc = {"command": "vpscluster bench faults " + " ".join(
        f"--{k.replace('_', '-')} {getattr(s, k)}" for k in ("strategies", "faults", "bandwidth", "preset", "gap_steps",
                                                              "checkpoint_every", "timeout_s")),
           "machine": _machine(), "max_steps": max_steps, "rows": rows, "runs": {k: _strip(v) for k, v in runs.items()},
           "results_dir": str(out)}
    (out / "results.json").write_text(json.dumps(doc, indent=1))
    (out / "table.md").write_text(markdown(rows) + "\n")
    return doc


# ---------------------------------------------------------------- the runs


def _config(s: FaultSettings, strategy: str) -> str:
    t = s.timeout_s
    lines = [f"checkpoint_every: {s.checkpoint_every}", "eval_every: 10", "eval_batches: 4", "keep_checkpoints: 3",
             f"timeouts: {{train_collective_s: {2 * t:g}, startup_collective_s: 90, rendezvous_s: 120, stop_grace_s: 10}}",
             "recovery: {max_restarts: 12, min_nodes: 2, rejoin_poll_s: 2}"]
    # A sync every checkpoint, each timed out and retried once, replicas' hashes logged: where the
    # strategy takes those settings (`costs.settings_keys`).
    sync = {"sync_every": s.checkpoint_every, "sync_timeout_s": f"{t:g}", "sync_retries": 1, "sync_hashes": "true"}
    costs = costs_for(strategy)
    lines.append("strategy: {" + ", ".join([f"name: {strategy}"] + [f"{k}: {v}" for k, v in sync.items() if costs.takes(k)]) + "}")
    return "\n".join(lines) + "\n"


def _argv(s: FaultSettings, info, config: Path, max_steps: int, run_dir: Path) -> list[str]:
    return ["train", "--cluster", info.cluster_file, "--config", str(config), "--preset", s.preset,
            "--max-steps", str(max_steps), "--run-dir", str(run_dir), "--json"]


def _faulty_run(s: FaultSettings, info, config: Path, max_steps: int, faults: list[str], run_dir: Path, say) -> dict[str, Any]:
    log = run_dir.with_suffix(".log")
    events = RunEvents(run_dir)
    injected: list[dict[str, Any]] = []
    with log.open("w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "vpscluster", *_argv(s, info, config, max_steps, run_dir)],
                                stdout=subprocess.PIPE, stderr=err, text=True)
        try:
            settled_step, settled_at = 0, time.time()
            for name in faults:
                rec = _inject_when_due(s, info, name, proc, events, settled_step + s.gap_steps, settled_at)
                if rec is None:
                    break
                injected.append(rec)
                say(f"  step {rec['step']}: {name} on {rec['node']}")
                _settle(s, rec, proc, events)
                say(f"    {'hang' if rec['hang'] else 'training again'} (step {events.step})")
                if rec["hang"] or proc.poll() is not None:
                    break
                settled_step, settled_at = events.step, time.time()
            stdout, _ = proc.communicate(timeout=max(600, 30 * max_steps))
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)  # the launcher stops the nodes' processes
                try:
                    proc.wait(timeout=120)
                except subprocess.TimeoutExpired:
                    proc.kill()
    # The run is over: every node answers again (a "dead" one, or a head cut off for longer than
    # the run had left) for the checks and the resume below.
    from vpscluster.cluster.sandbox import faults as sandbox_faults

    sandbox_faults.clear(s.name)
    if proc.returncode != 0:
        tail = log.read_text(errors="replace").strip().splitlines()[-1:] or ["(no output)"]
        return {"failed": f"the run with faults failed ({tail[0][:300]}); log: {log}", "faults": injected}
    report = json.loads(stdout)
    summary = _summary(report, run_dir)
    summary["faults"] = _attribute(injected, report.get("recoveries", []))
    summary["checkpoints_intact"] = _newest_checkpoint_intact(report, info)
    summary["checkpoint_failures"] = len([e for _, e in events.seen if e["event"] == "checkpoint_failed"])
    summary["faults"].append(_corrupt_and_resume(s, info, report, run_dir, max_steps, say))
    return summary


def _inject_when_due(s: FaultSettings, info, name: str, proc, events: RunEvents, due_step: int, since: float) -> dict | None:
    """Wait for step `due_step` (and a checkpoint since the last fault settled), then inject."""
    from vpscluster.cluster.sandbox import faults

    deadline = time.time() + s.hang_s + 60 * s.gap_steps
    while True:
        events.poll()
        ready = events.step >= due_step and events.since(since, "checkpoint")
        if name == "disk-full":  # just before a checkpoint is written
            ready = ready and events.step % s.checkpoint_every == s.checkpoint_every - 1
        if ready:
            break
        if proc.poll() is not None or time.time() > deadline:
            return None
        time.sleep(0.05)
    node, seconds, rate = {
        "worker-kill": ("node-2", 0, None), "link-5s": ("node-2", 5, None), "node-kill": ("node-2", 0, None),
        "stop": ("node-3", s.stop_s, None), "link-long": ("node-3", s.link_long_s, None),
        "head-down": ("node-1", s.head_down_s, None), "node-dead": ("node-3", DEAD_S, None),
        "disk-full": ("node-2", s.disk_full_s, None), "throttle": ("node-3", s.throttle_s, "1mbit"),
    }[name]
    rec = {"fault": name, "node": node, "seconds": seconds, "step": events.step, "at": time.time()}
    if name == "worker-kill":
        workers = [p for p in faults.node_pids(info, info.node(node)) if _is_worker(p)]
        if workers:
            os.kill(workers[0], signal.SIGKILL)
        if not workers:
            rec["error"] = f"no training process found on {node}"
    else:
        kind = {"link-5s": "link-down", "node-kill": "kill", "link-long": "link-down", "head-down": "link-down",
                "node-dead": "link-down"}.get(name, name)
        faults.inject(s.name, node, kind, seconds=seconds or None, rate=rate)
    rec["ends"] = rec["at"] + (0 if name == "node-dead" else seconds)  # a dead node does not come back
    rec["dead"] = name == "node-dead"
    return rec


def _settle(s: FaultSettings, rec: dict[str, Any], proc, events: RunEvents) -> None:
    """Wait until the fault is over and training runs again on every node: a step after its end,
    and (if it caused a relaunch) the latest launch on all three nodes - for a dead node, a
    relaunch on the two others."""
    deadline = rec["ends"] + s.hang_s
    rec["hang"] = False
    while time.time() < deadline:
        events.poll()
        starts = events.since(rec["at"], "start")
        if rec.get("dead"):
            whole = bool(starts) and starts[-1][1].get("world_size") == 2
        else:
            whole = not starts or starts[-1][1].get("world_size") == 3
        after = [at for at, _ in events.since(max(rec["ends"], starts[-1][0] if starts else 0), "step")]
        if time.time() >= rec["ends"] and whole and after:
            break
        if proc.poll() is not None:
            return
        time.sleep(0.1)
    else:
        rec["hang"] = True
    steps = [at for at, _ in events.since(rec["at"], "step")]
    gaps = [b - a for a, b in zip([rec["at"], *steps], steps)]
    rec["longest_pause_s"] = round(max(gaps), 1) if gaps else None


def _is_worker(pid: int) -> bool:
    """A training process itself (`python -m vpscluster.train.worker`): not the elastic agent
    that started it, nor a shell whose command line mentions it."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return False
    agent = any(m in a for a in argv[:6] for m in ("torch.distributed.run", "torchrun"))  # reap.py's markers
    return "vpscluster.train.worker" in argv and not agent and "python" in Path(argv[0]).name


def _attribute(injected: list[dict[str, Any]], recoveries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each fault with the recoveries the launcher recorded between it and the next fault."""
    rows = []
    for i, rec in enumerate(injected):
        until = injected[i + 1]["at"] if i + 1 < len(injected) else float("inf")
        mine = [r for r in recoveries if rec["at"] <= r.get("detected_at", 0) < until]
        restarts = [r for r in mine if r["kind"] == "restart"]
        rejoins = [r for r in mine if r["kind"] == "rejoin"]
        row = {k: rec[k] for k in ("fault", "node", "seconds", "step", "hang", "longest_pause_s", "error") if k in rec}
        row.update(restarts=len(restarts), rejoins=len(rejoins),
                   steps_lost=sum(max(0, r["after_step"] - r.get("resumed_from_step", r["after_step"])) for r in mine))
        if restarts:
            first = restarts[0]
            row["detected_after_s"] = round(first["detected_at"] - rec["at"], 1)
            row["training_again_after_s"] = first.get("training_again_after_s")
            row["out"] = sorted({n for r in restarts for n in r.get("out", [])})
        if rejoins and rejoins[-1].get("training_again_at"):
            row["rejoined_after_s"] = round(rejoins[-1]["training_again_at"] - rec["ends"], 1)
        rows.append(row)
    return rows


def _node_path(info, node: str, report: dict[str, Any], below: str) -> Path:
    """`below` in node `node`'s copy of the run directory, as this machine sees it (through the
    node's own root when it has one). Every node keeps the run at the same place in its workdir."""
    from vpscluster.cluster.sandbox import faults

    base = Path(report.get("node_run_dir") or report["run_dir"])
    head = info.node(report.get("rank0_node") or "node-1")
    n = info.node(node)
    if not base.is_absolute():  # the worker's path, relative to its node's workdir
        base = Path(n.workdir) / base
    elif base.is_relative_to(head.workdir):
        base = Path(n.workdir) / base.relative_to(head.workdir)
    path = str(base / below)
    if Path(path).exists():
        return Path(path)
    for pid in faults.node_pids(info, n):
        p = Path(f"/proc/{pid}/root") / path.lstrip("/")
        if p.exists():
            return p
    return Path(path)


def _newest_checkpoint_intact(report: dict[str, Any], info) -> bool | None:
    """Every shard of the run's newest checkpoint matches its manifest, on every node that holds
    it (a node that was out when it was taken holds only older ones); None: none found."""
    roots = {}
    for n in info.nodes:
        root = _node_path(info, n.name, report, "checkpoints")
        steps = sorted(p.name for p in root.glob("step-*") if ".abandoned" not in p.name) if root.is_dir() else []
        if steps:
            roots[n.name] = (root, steps[-1])
    if not roots:
        return None
    newest = max(last for _, last in roots.values())  # zero-padded step numbers: the names sort
    for root, _ in roots.values():
        d = root / newest
        if not d.is_dir():
            continue
        try:
            manifest = json.loads((d / "manifest.json").read_text())
        except (OSError, ValueError):
            return False
        for shard in d.glob("rank-*.pt"):
            rank = str(int(shard.stem.split("-")[1]))
            if hashlib.sha256(shard.read_bytes()).hexdigest() != manifest.get("sha256", {}).get(rank):
                return False
    return True


def _corrupt_and_resume(s: FaultSettings, info, report: dict[str, Any], run_dir: Path, max_steps: int, say) -> dict[str, Any]:
    """Flip bytes in the rank-0 node's shard of the newest checkpoint, then resume for gap_steps more."""
    from vpscluster.errors import RemoteError

    node = report.get("rank0_node") or "node-1"  # where the run ended: it holds the newest checkpoint
    root = _node_path(info, node, report, "checkpoints")
    steps = sorted(p for p in root.glob("step-*") if ".abandoned" not in p.name) if root.is_dir() else []
    row: dict[str, Any] = {"fault": "corrupt", "node": node, "seconds": 0, "step": report["steps"], "hang": False}
    if not steps:
        return {**row, "error": f"no checkpoint under {root}"}
    shard = sorted(steps[-1].glob("rank-*.pt"))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2 : len(data) // 2 + 8] = b"\xff" * 8
    shard.write_bytes(bytes(data))
    say(f"  {shard.parent.name}/{shard.name} on {node} corrupted; resuming for {s.gap_steps} more steps")
    t0 = time.time()
    try:
        r = _cli(["train", "--resume", str(run_dir), "--max-steps", str(max_steps + s.gap_steps), "--json"],
                 run_dir.with_name(run_dir.name + "-resume.log"), s.hang_s + 600)
    except (subprocess.TimeoutExpired, OSError, RemoteError) as e:
        return {**row, "hang": isinstance(e, subprocess.TimeoutExpired), "error": str(e).splitlines()[0][:300]}
    resumed = json.loads(r.stdout)
    newest = int(steps[-1].name.split("-")[1])
    row.update(restarts=0, rejoins=0, resumed_from_step=resumed.get("resumed_from_step"),
               steps_lost=newest - (resumed.get("resumed_from_step") or 0), resume_s=round(time.time() - t0, 1),
               steps_after=resumed["steps"])
    return row


def _summary(report: dict[str, Any], run_dir: Path) -> dict[str, Any]:
    ranks = report.get("per_rank") or []
    details = report.get("strategy_details") or {}
    return {"steps": report["steps"], "tokens": report["tokens"], "final_val_loss": report["final_val_loss"],
            "world_size": report.get("world_size"), "recoveries": report.get("recoveries", []),
            # rank 0's outer-sync counts (DiLoCo; carried over restarts in its checkpoints)
            "sync": ({k: details.get(k) or 0 for k in ("syncs_attempted", "syncs_retried", "syncs_failed")}
                     if "syncs_attempted" in details else None),
            "hashes": sorted({r.get("model_sha256") for r in ranks if r.get("model_sha256")}),
            "evals": evals_from_metrics(run_dir / "metrics.jsonl"), **_sync_agreement(run_dir)}


def _sync_agreement(run_dir: Path) -> dict[str, Any]:
    """DiLoCo (`sync_hashes`): outer syncs logged over every launch of the run, and those at which
    the replicas' global weights differed (must be 0)."""
    from vpscluster.launch.logs import diloco_sync_hashes

    syncs = diloco_sync_hashes(run_dir / "logs")
    if not syncs:
        return {}
    return {"syncs_checked": len(syncs), "syncs_differing": sum(1 for by_hash in syncs.values() if len(by_hash) > 1)}


def _strip(run: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in run.items() if k != "evals"}


# ---------------------------------------------------------------- the tables


def fault_rows(runs: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for name, r in runs.items():
        for f in r.get("faults", []):
            rows.append({"run": name.split("-")[0], **f})
    return rows


def run_rows(runs: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Per run with faults: final validation loss against the fault-free run at equal tokens."""
    rows = []
    for name, r in runs.items():
        if not name.endswith("-faults"):
            continue
        free = runs.get(name.replace("-faults", "-fault-free"))
        if "failed" in r or free is None:
            rows.append({"run": name, "failed": r.get("failed", "no fault-free run")})
            continue
        tokens = min(r["evals"][-1]["tokens"], free["evals"][-1]["tokens"]) if r["evals"] and free["evals"] else None
        mine = loss_at_tokens(r["evals"], tokens) if tokens else None
        theirs = loss_at_tokens(free["evals"], tokens) if tokens else None
        sync = r["sync"]
        rows.append({
            "run": name, "steps": r["steps"], "tokens": r["tokens"], "fault_free_tokens": free["tokens"],
            "at_tokens": tokens, "val_loss": mine, "fault_free_val_loss": theirs,
            "val_loss_diff_pct": 100 * (mine - theirs) / theirs if mine is not None and theirs else None,
            "hangs": sum(1 for f in r["faults"] if f.get("hang")),
            "restarts": sum(1 for x in r["recoveries"] if x["kind"] == "restart"),
            "rejoins": sum(1 for x in r["recoveries"] if x["kind"] == "rejoin"),
            "sync_failure_rate": sync["syncs_failed"] / sync["syncs_attempted"] if sync and sync["syncs_attempted"] else None,
            "syncs": f"{sync['syncs_attempted']}/{sync['syncs_retried']}/{sync['syncs_failed']}" if sync else None,
            "checkpoint_failures": r["checkpoint_failures"],
            "newest_checkpoint_intact": r["checkpoints_intact"], "replicas_identical": len(r["hashes"]) == 1,
            "syncs_agreeing": (f"{r['syncs_checked'] - r['syncs_differing']}/{r['syncs_checked']}"
                               if "syncs_checked" in r else None),
        })
    return rows


FAULT_COLUMNS = [("run", "run", "{}"), ("fault", "fault", "{}"), ("node", "node", "{}"), ("step", "at step", "{}"),
                 ("restarts", "restarts", "{}"), ("rejoins", "rejoins", "{}"),
                 ("detected_after_s", "detected after (s)", "{:.1f}"),
                 ("training_again_after_s", "training again after (s)", "{:.1f}"),
                 ("rejoined_after_s", "all nodes again after (s)", "{:.1f}"),
                 ("longest_pause_s", "longest pause (s)", "{:.1f}"), ("steps_lost", "steps lost", "{}"),
                 ("hang", "hang", "{}")]
RUN_COLUMNS = [("run", "run", "{}"), ("steps", "steps", "{}"), ("at_tokens", "at tokens", "{:.0f}"),
               ("val_loss", "val loss", "{:.4f}"), ("fault_free_val_loss", "fault-free", "{:.4f}"),
               ("val_loss_diff_pct", "diff", "{:+.2f}%"), ("hangs", "hangs", "{}"), ("restarts", "restarts", "{}"),
               ("rejoins", "rejoins", "{}"), ("syncs", "syncs tried/retried/failed (last launch)", "{}"),
               ("checkpoint_failures", "ckpt failures", "{}"), ("newest_checkpoint_intact", "newest ckpt intact", "{}"),
               ("replicas_identical", "replicas identical", "{}"),
               ("syncs_agreeing", "outer syncs with identical replicas", "{}")]


def cell(row, key, fmt) -> str:
    return table.cell(row, key, fmt, name_key="run")


def markdown(rows: list[dict[str, Any]]) -> str:
    faults = [r for r in rows if "fault" in r]
    runs = [r for r in rows if "fault" not in r]
    return table.markdown(faults, FAULT_COLUMNS, cell) + "\n\n" + table.markdown(runs, RUN_COLUMNS, cell)
