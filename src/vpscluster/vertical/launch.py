"""Start a vertical split: place the stages, send each node only its columns, run, collect the report.

    report = launch.train(spec, cluster=None, run_dir="runs/v1")   # None: every stage a local process

Stages (the launch pipeline's shape, over the project's executors: local processes or SSH):

    place     each tower on its node (`nodes:` names, else the first node with its `labels:`), the
              head on `head.node` or the cluster's head; a tower with no node is refused; a tower
              with replicas, one stage `NAME.r` per node (`nodes:`, or the first `replicas:` nodes
              carrying its labels)
    queue     the cluster's queue (`vpscluster queue up`, or the cluster file's server); on the local
              cluster, a private nats-server on loopback for this run (queue/server.serve_private)
    split     per stage one rows file holding only what it may see: a tower the id column and its
              columns, the head the id column and the label (`data.write_columns`); a tower's
              replica only its share of the rows, and the list of every id (the schedule's); these
              files are all of the data that goes to its node
    sync      to a remote node, the vpscluster package and the code the spec names (its top-level
              packages or module files, never the whole current folder, which may hold the data;
              by content hash, secrets left out: launch/sync.py), then the stage's rows file and spec
    start     `python -m vpscluster.vertical.worker` per stage, with the queue's credentials in its
              environment; every line it prints comes back prefixed with its stage
    wait      until every stage ends; a stage that dies (a tower or the head) is started again from
              its checkpoint, the others waiting on the queue; a stage out of restarts stops the
              others, and its last line is the error. When the dead stage's node does not answer
              (an SSH `true` within connect_timeout_s), the node is gone: the stage moves to
              another live node the tower may run on (one carrying its labels, or for a tower
              placed by `nodes:` another node listed there; any node for the head; the
              least-loaded, a node without a replica of the same tower first), its package and code are synced there,
              its rows file sent, and it resumes from its checkpoint on the queue's object store
              (every stage sends it there, vertical/checkpoint.py): "vertical: node-3 is gone;
              tower image.1 restarts on node-4 from step N". The report's `placement` says
              where each stage ended, `moves` each move
    collect   the head's report.json and every stage's weights into RUN_DIR/stages/<stage>/
"""

from __future__ import annotations

import asyncio
import json
import os
import posixpath
import time
import uuid
from pathlib import Path
from typing import Callable

from vpscluster.errors import RemoteError, UserError
from vpscluster.vertical import data
from vpscluster.vertical.spec import Spec, check, code_paths

START_TIMEOUT_S = 120.0  # a stage's first line (an interpreter importing torch on a busy node)


def place(spec: Spec, cluster) -> dict[str, str]:
    """stage -> node name: towers (each replica: `NAME.r`) by name or labels, then "head"."""
    names = [n.name for n in cluster.nodes]
    out = {}
    for tname, t in spec.towers.items():
        n = t.n_replicas
        stages = [tname] if n == 1 else [f"{tname}.{r}" for r in range(n)]
        if cluster.is_local:
            out.update({st: cluster.nodes[0].name for st in stages})
            continue
        if t.nodes:
            unknown = [x for x in t.nodes if x not in names]
            if unknown:
                raise UserError(f"towers.{tname}.nodes: no node {unknown[0]!r} in the cluster; its nodes: {', '.join(names)}")
            out.update(zip(stages, t.nodes))
        else:
            match = [x.name for x in cluster.nodes if all(x.labels.get(k) == str(v) for k, v in t.labels.items())]
            if len(match) < n:
                raise UserError(f"towers.{tname}.labels: {len(match)} node(s) of the cluster carry {t.labels}, "
                                f"{n} replica(s) wanted; label more in the cluster file or name them in nodes:")
            out.update(zip(stages, match))
    head = spec.head.node if spec.head.node and not cluster.is_local else cluster.head
    if head not in names:
        raise UserError(f"head.node: no node {head!r} in the cluster; its nodes: {', '.join(names)}")
    out["head"] = head
    return out


def split_rows(spec: Spec, rows: list[dict], out_dir: Path, weights_from: Path | None = None) -> dict[str, dict[str, Path]]:
    """stage -> the files it receives, by role: `rows` (only its columns; a tower's replica only
    its share of the rows, and `ids`, every sample id; the head's label only where the rows have
    it), and to predict, `weights` (its trained weights)."""
    from vpscluster.vertical.wire import split_stage

    ids = [r[spec.id_column] for r in rows]
    files: dict[str, dict[str, Path]] = {}
    for stage in spec.stages()[:-1]:
        tname, r = split_stage(stage)
        cols = [spec.id_column, *spec.towers[tname].columns]
        if r is None:
            files[stage] = {"rows": data.write_columns(rows, cols, out_dir / stage / "rows.jsonl")}
            continue
        owner = data.owner_of(ids, spec.towers[tname].n_replicas)
        share = [row for row in rows if owner[row[spec.id_column]] == r]
        files[stage] = {"rows": data.write_columns(share, cols, out_dir / stage / "rows.jsonl"),
                        "ids": data.write_ids(ids, out_dir / stage / "ids.json")}
    label = [spec.head.label] if all(spec.head.label in r for r in rows) else []
    files["head"] = {"rows": data.write_columns(rows, [spec.id_column, *label], out_dir / "head" / "rows.jsonl")}
    if weights_from is not None:
        for stage in files:
            tname = split_stage(stage)[0]
            # a tower trained with replicas: every replica holds the same weights; replica 0's
            found = [weights_from / "stages" / st / ("head.pt" if stage == "head" else f"tower-{tname}.pt")
                     for st in (stage, tname, f"{tname}.0")]
            w = next((f for f in found if f.is_file()), None)
            if w is None:
                raise UserError(f"--from {weights_from}: no trained weights of stage {stage} ({found[0]}); give the "
                                "run dir of a finished `vertical train`")
            files[stage]["weights"] = w
    return files


def prepare(spec: Spec, data_path: str | None, labels: bool = True) -> list[dict]:
    """The rows, after checking the spec against them (modules, columns, feature functions)."""
    path = data_path or spec.data
    if not path:
        raise UserError("no data: give --data FILE or the spec's data: key (JSON lines)")
    rows = data.read_rows(path)
    data.check_ids(rows, spec.id_column)
    check(spec, data.columns_of(rows) | (set() if labels else {spec.head.label}), rows[0])
    return rows


def train(spec: Spec, cluster=None, run_dir: str | Path | None = None, data_path: str | None = None,
          say: Callable[[str], None] = print) -> dict:
    """Run the split to the end; the head's report with where each stage ran and the run dir."""
    return _launch(spec, cluster, run_dir, data_path, say, None)


def predict(spec: Spec, from_run: str | Path, cluster=None, run_dir: str | Path | None = None,
            data_path: str | None = None, say: Callable[[str], None] = print) -> dict:
    """Every row through the trained stages of `from_run`; the head writes predictions.jsonl."""
    return _launch(spec, cluster, run_dir, data_path, say, Path(from_run).resolve())


def _launch(spec: Spec, cluster, run_dir, data_path, say, weights_from: Path | None) -> dict:
    from vpscluster.cluster.inventory import local_cluster

    cluster = cluster or local_cluster()
    run_id = uuid.uuid4().hex[:10]
    kind = "vertical" if weights_from is None else "vertical-predict"
    run_dir = Path(run_dir or Path("runs") / f"{kind}-{run_id}").resolve()
    rows = prepare(spec, data_path, labels=weights_from is None)
    placement = place(spec, cluster)
    files = split_rows(spec, rows, run_dir / "send", weights_from)
    spec_file = run_dir / "spec.json"
    spec_file.write_text(json.dumps(spec.to_dict(), indent=2) + "\n")

    private = None
    if cluster.is_local and getattr(cluster, "queue", None) is None:
        from vpscluster.queue.server import serve_private

        private = serve_private(run_dir / "queue")
        creds = private.creds
        say(f"queue: a private nats-server for this run at {creds.url}")
    else:
        from vpscluster.queue.server import credentials

        creds = credentials(cluster)
        if creds is None:
            raise UserError("no queue for this cluster; start one with `vpscluster queue up --cluster FILE`")
    try:
        report = asyncio.run(_run(spec, cluster, placement, files, spec_file, run_id, run_dir, creds, say))
    finally:
        try:
            _drop_stream(creds, run_id, say)
        finally:
            if private is not None:
                private.stop()
    report.update({"run_id": run_id, "run_dir": str(run_dir), "placement": placement, "queue": creds.url})
    (run_dir / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


def _drop_stream(creds, run_id: str, say: Callable[[str], None]) -> None:
    """The run's stream is its scratch: removed once the run ended, so a cluster's queue does not
    keep it until its retention ends (a queue that does not answer now keeps it; said, not raised)."""
    from vpscluster.queue.client import Queue, QueueError
    from vpscluster.vertical.checkpoint import bucket_of
    from vpscluster.vertical.wire import stream_name

    try:
        with Queue(creds, timeout_s=5.0) as q:
            q.delete_stream(stream_name(run_id))
            q.delete_bucket(bucket_of(run_id))
    except QueueError as e:
        say(f"note: the run's stream {stream_name(run_id)} stays on the queue: {e}")


async def _run(spec, cluster, placement, files, spec_file, run_id, run_dir, creds, say) -> dict:
    from vpscluster.cluster.inventory import open_executors
    from vpscluster.launch.commands import LAUNCH_ID_ENV
    from vpscluster.launch.preflight import resolve_workdirs
    from vpscluster.launch.pipeline import SyncItem, local_side
    from vpscluster.launch.sync import PACKAGE_ON_NODE, package_dir, sync_dir
    from vpscluster.vertical.wire import split_stage

    timeout_s = cluster.connect_timeout_s + cluster.command_timeout_s
    package = package_dir()
    async with open_executors(cluster) as executors:
        by_name = {ex.node.name: ex for ex in executors}
        workdirs = await resolve_workdirs([by_name[n] for n in dict.fromkeys(placement.values())], timeout_s)
        pythonpath: dict[str, str] = {}
        # Only the code the spec names goes to remote nodes (its top-level packages or module files),
        # never the current folder as a whole: it may hold the dataset, all of whose columns must not travel.
        code = [(path, *local_side(SyncItem("code", path, ""))) for path in code_paths(spec)]

        async def ready(name: str) -> None:
            """`name`'s workdir, the package and the spec's code there (once per node)."""
            ex = by_name[name]
            if name in pythonpath:
                return
            if name not in workdirs:
                workdirs.update(await resolve_workdirs([ex], timeout_s))
            if ex.node.local:
                pythonpath[name] = os.pathsep.join([os.getcwd(), os.path.dirname(package)])
            else:  # the package and the user's code (the spec's modules), by content hash, secrets left out
                pkg = await sync_dir(ex, package, posixpath.join(workdirs[name], PACKAGE_ON_NODE),
                                     timeout_s=max(timeout_s, 300.0), say=say)
                user_root = posixpath.join(workdirs[name], "code/vertical", run_id)
                for path, root, manifest in code:  # a package lands as user_root/<name>, a module file in user_root
                    there = posixpath.join(user_root, os.path.basename(path)) if os.path.isdir(path) else user_root
                    await sync_dir(ex, root, there,
                                   timeout_s=max(timeout_s, 300.0), manifest=manifest, detect_shared=False, say=say)
                pythonpath[name] = f"{user_root}:{posixpath.dirname(pkg.remote_path)}"

        for name in dict.fromkeys(placement.values()):
            await ready(name)

        async def start(stage: str, resume: bool = False):
            node = placement[stage]
            ex = by_name[node]
            if ex.node.local:
                stage_dir, spec_path = str(run_dir / "stages" / stage), str(spec_file)
                sent = {role: str(f) for role, f in files[stage].items()}
            else:
                stage_dir = posixpath.join(workdirs[node], "runs", f"vertical-{run_id}", stage)
                spec_path = posixpath.join(stage_dir, "spec.json")
                sent = {role: posixpath.join(stage_dir, "in", f.name) for role, f in files[stage].items()}
                for role, f in files[stage].items():  # this stage's columns (and ids, weights), nothing else
                    await ex.put(str(f), sent[role], timeout_s=timeout_s)
                await ex.put(str(spec_file), spec_path, timeout_s=timeout_s)
            tname, replica = split_stage(stage)
            role = ["head"] if stage == "head" else ["tower", tname]
            argv = [ex.node.python, "-m", "vpscluster.vertical.worker", *role, "--spec", spec_path, "--rows", sent["rows"],
                    "--run", run_id, "--out", stage_dir,
                    *(["--replica", str(replica), "--ids", sent["ids"]] if replica is not None else []),
                    *(["--weights", sent["weights"]] if "weights" in sent else []),
                    *(["--resume"] if resume else [])]
            env = {**creds.env(), LAUNCH_ID_ENV: run_id, "PYTHONPATH": pythonpath[node], "PYTHONUNBUFFERED": "1",
                   "OMP_NUM_THREADS": "1"}
            last = {"t": time.monotonic()}

            def on_line(stream: str, line: str) -> None:
                last["t"] = time.monotonic()
                if not line.startswith("{"):
                    say(f"[{stage}@{node}] {line}")
            handle = await ex.start(argv, on_line=on_line, env=env, cwd=workdirs[node])
            return stage, handle, stage_dir, last

        moves: list[dict] = []
        mover = _Mover(spec, cluster, by_name, placement, say)

        async def revive(stage: str):
            """Start a dead stage again from its checkpoint: on its node, or, when that node is
            gone, on another one (the checkpoint comes from the queue there)."""
            old = placement[stage]
            if not await mover.alive(old):
                new = await mover.pick(stage)
                await ready(new)
                step = await asyncio.to_thread(_checkpoint_step, creds, run_id, stage)
                placement[stage] = new
                moves.append({"stage": stage, "from": old, "to": new, "step": step})
                what = "the head" if stage == "head" else f"tower {stage}"
                say(f"vertical: {old} is gone; {what} restarts on {new} from step {step or 0}"
                    + ("" if step else " (no checkpoint on the queue yet)"))
            return await start(stage, resume=True)

        started = []
        try:
            for stage in spec.stages():
                started.append(await start(stage))
            restarts = await _wait(started, spec.train.timeout_s, spec.train.max_restarts, revive, say)
            head_dir = next(d for s, _, d, _ in started if s == "head")
            local_stages = run_dir / "stages"
            for stage, _, stage_dir, _ in started:
                ex = by_name[placement[stage]]
                if not ex.node.local:
                    await ex.get(stage_dir, str(local_stages / stage), timeout_s=timeout_s)
            report_file = (local_stages / "head" / "report.json") if not by_name[placement["head"]].node.local \
                else Path(head_dir) / "report.json"
            return {**json.loads(report_file.read_text()), "restarts": restarts, "moves": moves}
        finally:
            await asyncio.gather(*(h.stop(grace_s=2.0) for _, h, _, _ in started), return_exceptions=True)


def _checkpoint_step(creds, run_id: str, stage: str) -> int | None:
    """The step of `stage`'s checkpoint on the queue (None: none there yet)."""
    from vpscluster.queue.client import Queue
    from vpscluster.vertical.checkpoint import step_on_queue

    with Queue(creds, timeout_s=10.0) as q:
        return step_on_queue(q, run_id, stage)


class _Mover:
    """Whether a stage's node still answers, and where a stage goes when it does not: the live
    nodes the tower may run on (those carrying its labels; for a tower placed by `nodes:`, only the
    nodes listed there, so its columns never reach a node the spec did not name; any node for the
    head), fewest stages first, a node without another replica of the same tower before one with."""

    def __init__(self, spec: Spec, cluster, executors: dict, placement: dict[str, str], say):
        self.spec, self.cluster, self.executors, self.placement, self.say = spec, cluster, executors, placement, say
        self.gone: set[str] = set()

    async def alive(self, node: str) -> bool:
        """Whether `node` can take a stage: the launcher's own check (`launch.recovery.ready`: a
        command over SSH within the connect time-out, and its overlay interface where there is one).
        A node that fails it is gone for the rest of the run."""
        from vpscluster.launch.recovery import ready

        if self.executors[node].node.local:
            return True
        if node in self.gone:
            return False
        ok = node in await ready(self.cluster, [node])
        if not ok:
            self.gone.add(node)
        return ok

    async def pick(self, stage: str) -> str:
        from collections import Counter

        from vpscluster.vertical.wire import split_stage

        tname = split_stage(stage)[0]
        tower = self.spec.towers.get(tname) if stage != "head" else None
        labels = tower.labels if tower is not None and not tower.nodes else {}
        named = set(tower.nodes) if tower is not None and tower.nodes else None
        load = Counter(n for st, n in self.placement.items() if st != stage)
        siblings = {n for st, n in self.placement.items() if st != stage and split_stage(st)[0] == tname}
        nodes = [n for n in self.cluster.nodes if n.name not in self.gone and (named is None or n.name in named)
                 and all(n.labels.get(k) == str(v) for k, v in labels.items())]
        for n in sorted(nodes, key=lambda n: (n.name in siblings, load[n.name])):
            if await self.alive(n.name):
                return n.name
        if named is not None:
            raise RemoteError(f"stage {stage}: its node {self.placement[stage]} is gone and no other node of "
                              f"towers.{tname}.nodes {sorted(named)} answers; name another node there (or place the "
                              "tower by labels:) and run again")
        carrying = f" carrying {labels}" if labels else ""
        raise RemoteError(f"stage {stage}: its node {self.placement[stage]} is gone and no other node{carrying} "
                          "answers; add or label a node in the cluster file and run again")


async def _wait(started: list, timeout_s: float, max_restarts: int, restart, say) -> dict[str, int]:
    """Until every stage ended. A stage that dies (a tower or the head) is started again from its
    checkpoint (`restart(stage)`: on its node, or on another when its node is gone), at most
    `max_restarts` times each, while the others wait on the queue; a stage out of restarts, or every stage silent far past its own time-outs,
    ends all. Returns the restarts per stage."""
    silent_limit = START_TIMEOUT_S + 3 * timeout_s
    restarts: dict[str, int] = {}
    while True:
        states = [(stage, h.returncode, last) for stage, h, _, last in started]
        states.sort(key=lambda st: st[0] != "head")  # the head out of restarts ends the run: no tower restarts then
        restarted = False
        for stage, rc, _ in states:
            if rc not in (None, 0):
                k = next(i for i, st in enumerate(started) if st[0] == stage)
                h = started[k][1]
                lines = [ln for ln in h.output_tail.text().splitlines() if ln.strip()]
                why = lines[-1].strip() if lines else "no output"
                if restarts.get(stage, 0) < max_restarts:
                    restarts[stage] = restarts.get(stage, 0) + 1
                    say(f"stage {stage} died (exit status {rc}: {why}); starting it again from its checkpoint "
                        f"({restarts[stage]} of {max_restarts})")
                    started[k] = await restart(stage)
                    restarted = True
                    continue
                raise RemoteError(f"stage {stage} failed (exit status {rc}): {why}")
        if restarted:
            continue
        if all(rc == 0 for _, rc, _ in states):
            return restarts
        quiet = min(time.monotonic() - last["t"] for _, rc, last in states if rc is None)
        if quiet > silent_limit:
            raise RemoteError(f"every running stage was silent for {quiet:.0f} s; stopped them (train.timeout_s "
                              "bounds each wait on the queue)")
        await asyncio.sleep(0.2)
