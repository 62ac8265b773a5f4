"""A launch as named stages: preflight → sync → prepare → start → stream → collect → teardown.

`vpscluster run` and `vpscluster train` (on a cluster file or on the local cluster: one local
node, this machine) describe what to run as a `Job`; this module does the rest the same way for
all of them. `--dry-run` is the build part alone (no stage touches a node), so it prints
exactly the commands a launch would run. Whatever ends the run — success, a
node failing, Ctrl-C or SIGTERM to the launcher — teardown runs and checks every node.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import posixpath
import re
import signal
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Awaitable, Callable

from vpscluster.errors import RemoteError, UserError, unless_interrupted
from vpscluster.launch.commands import (
    DEFAULT_RDZV_PORT, LaunchOptions, NodeCommand, NodeTarget, Program, build_node_commands, render_dry_run,
)
from vpscluster.launch.preflight import NodeState


# The event a launcher hands its `on_event` after each launch ends, whatever the outcome (rank 0's
# own events come from the nodes: train/events.py). Subscribers such as monitoring's
# (`monitor/targets.py`) undo there what a launch's "start" made them do.
LAUNCH_ENDED = "launch_ended"


@dataclass
class SyncItem:
    """A file or folder of the launcher that every node needs, and where it goes under the workdir."""

    key: str  # "code", "data", ...
    local_path: str
    remote_rel: str  # relative to the node's workdir


@dataclass
class Job:
    cluster: Any  # vpscluster.cluster.node.Cluster
    program: Program
    run_dir: Path  # on the launching machine: logs/<node>.log and the fetched files land here
    run_id: str
    syncs: list[SyncItem] = field(default_factory=list)
    cwd_key: str | None = None  # the sync item each node runs in; None: the node's workdir
    nproc_per_node: int = 0  # 0: one per GPU, else one
    join_timeout_s: float = 600.0
    store_timeout_s: float = 300.0
    fetch: list[str] = field(default_factory=list)  # files of the node run dir, from rank 0's node
    # Files the program may not write at all (a script without the session API writes no
    # report.json): a missing one is skipped without a remark.
    fetch_optional: bool = False
    # Fetch them after an interrupt too, when this says the program finished them (e.g. a stop
    # that saved a checkpoint wrote its report); otherwise an interrupted run fetches nothing.
    fetch_when_interrupted: Callable[[], bool] | None = None
    # Files fetched from rank 0's node even when the launch failed (what it wrote so far), if it answers.
    fetch_after_failure: list[str] = field(default_factory=list)
    # The program once the nodes are known (e.g. the backend follows their accelerators).
    program_for: Callable[[dict[str, NodeState]], Program] | None = None
    # Extra environment for a node, from its state and where its synced items are.
    env_for: Callable[[NodeState, dict[str, str]], dict[str, str]] | None = None
    # Called before start with (executor, state, synced paths, node run dir).
    prepare: Callable[[Any, NodeState, dict[str, str], str], Awaitable[None]] | None = None
    # Called with every node's state right after pre-flight: raise a UserError to refuse the
    # job before anything is copied, created or started (e.g. a per-rank list of the wrong length).
    check_states: Callable[[dict[str, NodeState]], None] | None = None
    force: bool = False
    # A relaunch of a run (launch/recovery.py): pre-flight takes the cluster's last probe however
    # old it is (the first launch checked it; nothing to probe again while training waits).
    relaunch: bool = False
    # False: always copy, even where a node sees the launcher's files at the same path.
    detect_shared: bool = True
    rdzv_id: str | None = None
    rdzv_port: int | None = None
    on_event: Callable[[dict], None] | None = None
    # (before the program's "start" event, after it): stop the run when no node printed anything
    # for that long — something hangs that the workers' own time-outs cannot see. None: no limit.
    silence_limits_s: tuple[float, float] | None = None
    say: Callable[[str], None] = print  # launcher remarks and node lines for people
    # The run dir on every node, relative to its workdir or absolute; None: runs/<run id>. The
    # local cluster uses the launcher's own run dir, so nothing is copied back and forth.
    run_dir_on_node: str | None = None
    # Called once every node passed pre-flight and holds its files, before anything is written
    # for the run: a launch refused earlier leaves nothing behind (train creates its run dir here).
    create_run: Callable[[], None] | None = None
    # logs/<file name> per node (default <node>.log).
    log_names: dict[str, str] = field(default_factory=dict)
    # Stopping (teardown, the node-side guard): SIGTERM, this long to finish (training saves a
    # checkpoint in it), then SIGKILL. None: 5 s in the guard, 6 s at teardown.
    stop_grace_s: float | None = None
    # Started with the run: when it returns, the run is stopped as by Ctrl-C (SIGTERM to the
    # workers, which checkpoint) and the result says `stopped_by_job` (e.g. a node is back).
    stop_when: Callable[[], Awaitable[Any]] | None = None
    # The quorum engine (`launch/quorum.py`): a lighthouse on the head, a rendezvous of its own on
    # every node (one replica group each), and a failed node does not end the launch.
    quorum: Any = None  # launch.quorum.QuorumPlan
    # Every node the run knows (the supervisor's: those out of this launch too); a node in the
    # cluster file that is not among them is one added while the job runs. None: the job's nodes.
    known_nodes: list[str] | None = None

    def node_run_dir(self, workdir: str) -> str:
        return posixpath.join(workdir, self.run_dir_on_node or posixpath.join("runs", self.run_id))


@dataclass
class NodeOutcome:
    name: str
    exit_status: int | None = None
    first_error: str | None = None
    log: str | None = None
    sync: list[dict] = field(default_factory=list)
    left_running: list[int] = field(default_factory=list)
    teardown_error: str | None = None


@dataclass
class LaunchResult:
    ok: bool
    exit_status: int
    run_dir: str
    rdzv_id: str
    nodes: list[NodeOutcome]
    error: str | None = None
    interrupted: bool = False
    stopped_by_job: bool = False  # the interrupt came from Job.stop_when, not from a person
    # The quorum engine's lighthouse ended: the run's own failure, not the program's (the relaunch
    # path takes over even where the program saved no checkpoint).
    lighthouse_ended: bool = False
    ended_at: float | None = None  # time.monotonic() when the end was seen (a failure: its detection)
    failed_node: str | None = None  # the node blamed for a failure (its outcome has the first error)
    rank0_node: str | None = None
    wall_seconds: float = 0.0
    fetched: list[str] = field(default_factory=list)
    # The quorum engine: nodes whose replica group failed while the others trained on, and when
    # the launcher saw each (time.monotonic()).
    lost_nodes: list[str] = field(default_factory=list)
    lost_at: list[float] = field(default_factory=list)
    # Lost nodes started again within the launch once they answered (they healed from a peer), when
    # the launcher saw each answer, and when each logged its first outer sync after (time.monotonic()).
    back_nodes: list[str] = field(default_factory=list)
    back_at: list[float] = field(default_factory=list)
    first_sync_at: list[float | None] = field(default_factory=list)
    # Nodes added to the running job (the cluster file edited: launch/grow.py), when the launcher saw
    # each (time.monotonic()), when the file was changed (Unix time), and when each logged its first
    # outer sync (time.monotonic(); None: it did not). `added`: their cluster-file entries.
    joined_nodes: list[str] = field(default_factory=list)
    joined_at: list[float] = field(default_factory=list)
    joined_file_at: list[float | None] = field(default_factory=list)
    join_sync_at: list[float | None] = field(default_factory=list)
    added: list[Any] = field(default_factory=list)
    # Nodes drained (removed from the cluster file: they left at a sync), when the launcher saw
    # each end (time.monotonic()) and the step after which each left; `removed_nodes`: every node
    # the file took out of the run (drained, or out of it already).
    drained_nodes: list[str] = field(default_factory=list)
    drained_at: list[float] = field(default_factory=list)
    drained_step: list[int | None] = field(default_factory=list)
    removed_nodes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        import dataclasses

        return dataclasses.asdict(self)


# --- build (pure; also the dry run) ----------------------------------------------------------


def node_targets(job: Job, states: dict[str, NodeState], synced: dict[str, dict[str, str]],
                 nproc: dict[str, int]) -> list[NodeTarget]:
    targets = []
    for node in job.cluster.nodes:
        st = states[node.name]
        where = synced.get(node.name, {})
        cwd = where[job.cwd_key] if job.cwd_key else st.workdir
        env = job.env_for(st, where) if job.env_for else {}
        targets.append(NodeTarget(
            name=node.name, address=st.address, python=node.python, cwd=cwd, nproc=nproc[node.name],
            interface=st.interface, env=tuple(env.items()),
            # torchrun's own per-rank log files go into the node's run dir, never to /tmp.
            log_dir=torchelastic_dir(job, st.workdir),
        ))
    return targets


def torchelastic_dir(job: Job, workdir: str) -> str:
    return posixpath.join(job.node_run_dir(workdir), "logs", "torchelastic")


def build_commands(job: Job, states, synced, rdzv_id: str, rdzv_port: int,
                   own_ports: dict[str, int | str] | None = None, lighthouse: str | None = None,
                   planned: int | None = None, only: str | None = None,
                   indexes: dict[str, int] | None = None) -> list[NodeCommand]:
    """Every node's command. The quorum engine (`job.quorum`): each node a torchrun of its own on
    `own_ports[node]`, with its replica group's environment (`lighthouse`: the lighthouse's URL).
    `planned`: the replica groups the launch started with (default: every node); a node added
    since (its place in the list at or past it) is replica INDEX of INDEX + 1: a fresh replica
    id, and a data shard of its own that overlaps the others' in part (they keep theirs). `only`:
    that node's command alone (a node brought into a running launch: others may still be joining).
    `indexes`: each node's replica index where it is not its place in the list (added nodes get
    theirs once, never reused: a failed join's is skipped, so no two replica groups share an id)."""
    import dataclasses

    nproc = {n: job.nproc_per_node or max(1, states[n].gpus) for n in states}
    options = LaunchOptions(rdzv_id=rdzv_id, rdzv_port=rdzv_port, join_timeout_s=job.join_timeout_s,
                            store_timeout_s=job.store_timeout_s)
    program = job.program_for(states) if job.program_for else job.program
    targets = node_targets(job, states, synced, nproc)
    if job.quorum is None:
        return build_node_commands(targets, job.cluster.head, program, options)
    from vpscluster.launch.quorum import DRAIN_FILE, replica_env

    commands = []
    planned = planned or len(targets)
    for place, t in enumerate(targets):
        if only is not None and t.name != only:
            continue
        i = (indexes or {}).get(t.name, place)
        count = planned if i < planned else i + 1
        drain = posixpath.join(job.node_run_dir(states[t.name].workdir), DRAIN_FILE)
        env = replica_env(i, count, lighthouse, t.address, drain, job.quorum.heartbeat_timeout_ms)
        t = dataclasses.replace(t, env=t.env + tuple(env.items()))
        own = dataclasses.replace(options, rdzv_port=own_ports[t.name])
        (c,) = build_node_commands([t], t.name, program, own)  # is_host=1: its own store
        c.is_head = t.name == job.cluster.head  # the lighthouse's node
        commands.append(c)
    return commands


def dry_run(job: Job) -> dict[str, Any]:
    """The per-node commands and environment, touching no node."""
    from vpscluster.launch.preflight import node_endpoints
    from vpscluster.probe.store import load_probe

    probe = load_probe(job.cluster, None)
    facts = {n["name"]: n for n in (probe or {}).get("nodes", [])}
    endpoints = node_endpoints(job.cluster, facts, resolve=False)
    states, synced, notes = {}, {}, []
    for node in job.cluster.nodes:
        f = facts.get(node.name, {})
        gpus = f.get("gpus") or []
        end = endpoints[node.name]
        states[node.name] = NodeState(node.name, end.address, node.workdir, interface=end.interface,
                                      gpus=len(gpus) if isinstance(gpus, list) else int(gpus),
                                      cuda=bool(f.get("cuda_available")))
        synced[node.name] = {s.key: posixpath.join(node.workdir, s.remote_rel) for s in job.syncs}
    if any(e.via == "overlay" for e in endpoints.values()):
        iface = next(iter(endpoints.values())).interface
        notes.append(f"network: the provisioned WireGuard overlay ({iface}); its addresses carry the rendezvous "
                     "and gloo/NCCL (checked on each node at launch)")
    if any(s.interface is None for s in states.values()):
        notes.append("GLOO_SOCKET_IFNAME/NCCL_SOCKET_IFNAME: found on each node at launch (`ip -o addr`); "
                     "run `vpscluster probe` to see them here")
    if job.syncs:
        notes.append("synced files go under each node's workdir; a node that already holds them at the "
                     "launcher's path (shared file system) uses that path instead")
    if job.quorum is not None:
        from vpscluster.launch.quorum import lighthouse_url

        head = states[job.cluster.head]
        notes.append(f"quorum: torchft's lighthouse on {job.cluster.head} ({head.address}, a free port at launch: "
                     f"PORT; at least {job.quorum.min_replicas} replica groups), each node its own rendezvous "
                     f"(one replica group; a free port on it at launch, {DEFAULT_RDZV_PORT} shown); a node that "
                     "fails does not stop the others")
        commands = build_commands(job, states, synced, job.rdzv_id or "<fresh id per launch>", DEFAULT_RDZV_PORT,
                                  {n: DEFAULT_RDZV_PORT for n in states}, lighthouse_url(head.address, "PORT"))
        return render_dry_run(commands, notes)
    if job.rdzv_port is None:
        notes.append(f"rendezvous port: a free port on the head at launch ({DEFAULT_RDZV_PORT} shown)")
    commands = build_commands(job, states, synced, job.rdzv_id or "<fresh id per launch>",
                              job.rdzv_port or DEFAULT_RDZV_PORT)
    return render_dry_run(commands, notes)


# --- the stages --------------------------------------------------------------------------------


def launch(job: Job) -> LaunchResult:
    """Run the job on the cluster; never leaves a process behind."""
    from vpscluster.cluster.netsafety import require_safe_network

    require_safe_network(job.cluster)  # public addresses without an overlay: refused, one line
    return asyncio.run(_launch(job))


async def _launch(job: Job) -> LaunchResult:
    from vpscluster.cluster.inventory import open_executors

    started = time.monotonic()
    loop = asyncio.get_running_loop()
    interrupted = asyncio.Event()
    handled = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, interrupted.set)
            handled.append(sig)
        except (ValueError, RuntimeError):  # not the main thread (a library caller): no signals here
            pass
    try:
        async with open_executors(job.cluster) as executors:
            result = await _stages(job, executors, interrupted)
    finally:
        for sig in handled:
            loop.remove_signal_handler(sig)
    result.wall_seconds = round(time.monotonic() - started, 2)
    return result


async def _stages(job: Job, executors, interrupted: asyncio.Event) -> LaunchResult:
    from vpscluster.launch import preflight as pf
    from vpscluster.launch.logs import LogRouter
    from vpscluster.launch.hung import find_hung
    from vpscluster.launch.teardown import NODE_LOCK, guarded, teardown

    timeout_s = job.cluster.connect_timeout_s + job.cluster.command_timeout_s
    by_name = {ex.node.name: ex for ex in executors}
    rdzv_id = job.rdzv_id or uuid.uuid4().hex
    outcomes = {ex.node.name: NodeOutcome(ex.node.name) for ex in executors}

    # preflight: reachable, workdir, probe, interfaces, port.
    job.say(f"pre-flight on {len(executors)} nodes")
    facts = await unless_interrupted(pf.probe_facts(job.cluster, executors, job.force, job.say,
                                                    any_age=job.relaunch), interrupted) if not _all_local(job) else {}
    states = await unless_interrupted(pf.preflight(job.cluster, executors, facts, timeout_s), interrupted)
    if job.check_states is not None:
        job.check_states(states)
    head = by_name[job.cluster.head]
    own_ports = None
    if job.quorum is None:
        port = job.rdzv_port or await pf.free_port(head, states[head.node.name].address, timeout_s)
    else:  # a rendezvous port on every node, and the lighthouse's on the head
        own_ports, port = await unless_interrupted(_quorum_ports(by_name, states, head, timeout_s), interrupted)

    # sync: code and data, by content hash.
    synced: dict[str, dict[str, str]] = {n: {} for n in states}
    await unless_interrupted(sync_items(job, executors, states, synced, outcomes, timeout_s), interrupted)

    # prepare: each node's run dir (and what the job puts there).
    if job.create_run is not None:
        job.create_run()
    await unless_interrupted(prepare_nodes(job, executors, states, synced, timeout_s), interrupted)
    lighthouse_at = None
    if job.quorum is not None:
        from vpscluster.launch.quorum import lighthouse_url

        lighthouse_at = lighthouse_url(states[head.node.name].address, port)
    commands = build_commands(job, states, synced, rdzv_id, port, own_ports, lighthouse_at)

    # start + stream.
    # The quorum engine: every node's process is rank 0 of its own group; the head's (replica
    # group 0) speaks for the run.
    router = LogRouter(job.run_dir / "logs", list(states), show=job.say, on_event=job.on_event,
                       file_names=job.log_names, events_from=job.cluster.head if job.quorum is not None else None)
    handles = []
    lighthouse = None  # the quorum engine's lighthouse handle on the head
    watched = None
    hung = None  # (node, reason) when a node was found hanging after a failure
    error = None
    failed = None
    was_interrupted = False
    silent_s = None
    seen_at = None
    stopper = None
    by_job: list[bool] = []
    try:
        if job.stop_when is not None:
            async def stop_when():
                await job.stop_when()
                by_job.append(True)
                interrupted.set()
            stopper = asyncio.ensure_future(stop_when())
        for c in commands:
            router.note(c.node, "$ " + c.shell())
        if job.quorum is not None:
            from vpscluster.launch.quorum import start_lighthouse

            router.note(head.node.name, f"starting the quorum's lighthouse at {lighthouse_at}")
            lighthouse = await unless_interrupted(start_lighthouse(
                head, states[head.node.name].address, port, job.quorum, rdzv_id, None, job.stop_grace_s or 5.0,
                router.for_node(head.node.name)), interrupted)
        async def start(c: NodeCommand, on_line):
            # Under the node-side guard: a launcher that dies (even by SIGKILL) leaves nothing running.
            # And under the run's node lock: a second launch of this run is refused while this one lives.
            line = guarded(c.argv[0], rdzv_id, c.shell(), grace_s=job.stop_grace_s or 5.0,
                           lock_path=posixpath.join(job.node_run_dir(states[c.node].workdir), NODE_LOCK))
            return await by_name[c.node].start(line, on_line=on_line)

        if lighthouse is not None:
            from vpscluster.launch.quorum import Watched, drain_watch, watch

            watched = Watched()
        for c in commands:  # one by one into `handles`, so a failed start still stops the started
            on_line = router.for_node(c.node)
            handles.append(await start(c, drain_watch(watched, c.node, on_line) if watched is not None else on_line))
        if lighthouse is None:
            failed, was_interrupted, silent_s = await _watch(handles, interrupted, router, job.silence_limits_s)
        else:
            rejoin = _quorum_rejoin(job, executors, by_name, states, synced, outcomes, rdzv_id, port, own_ports,
                                    lighthouse_at, router, watched, start, timeout_s)
            await watch(handles, lighthouse, interrupted, router, job.silence_limits_s, job.say, rejoin, watched)
            failed, was_interrupted, silent_s = watched.failed, watched.interrupted, watched.silent_s
        seen_at = time.monotonic()
        if failed is not None or silent_s is not None:  # before teardown: a stopped node is still there to see
            hung = await find_hung(executors, rdzv_id)
            if hung is not None:  # its channels send no exit status: teardown need not wait for one
                by_name[hung[0]].note_hung(hung[1])
    finally:
        if stopper is not None:
            stopper.cancel()
        if was_interrupted and not by_job:
            job.say("interrupted: stopping every process on every node")
        reaped = await asyncio.shield(teardown(executors, handles + ([lighthouse] if lighthouse else []), rdzv_id,
                                               grace_s=job.stop_grace_s or 6.0))
        router.close()
    for h in handles:
        outcomes[h.node].exit_status = h.returncode
    for name, o in outcomes.items():
        if not was_interrupted and (o.exit_status not in (0, None) or name == failed):
            o.first_error = router.first_error(name)
        o.log = str(router.nodes[name].path)
    for r in reaped:
        outcomes[r.node].left_running = r.left
        outcomes[r.node].teardown_error = r.error
    unclean = [r for r in reaped if not r.clean]

    # collect: the report and metrics from the node that ran rank 0.
    fetched = []
    rank0 = router.rank0_node or job.cluster.head
    if watched is not None and rank0 in watched.lost:  # the quorum went on without it: a survivor's files
        rank0 = next((h.node for h in handles if h.node not in watched.lost and h.returncode == 0), rank0)
    if job.fetch and not was_interrupted and failed is None and silent_s is None:
        fetched = await _fetch(by_name[rank0], job, states[rank0].workdir, timeout_s)
    elif job.fetch and was_interrupted and job.fetch_when_interrupted is not None and job.fetch_when_interrupted():
        fetched = await _fetch(by_name[rank0], job, states[rank0].workdir, min(timeout_s, 30.0))
    elif job.fetch_after_failure and not was_interrupted and rank0 in states:
        fetched = await _fetch(by_name[rank0], job, states[rank0].workdir, min(timeout_s, 20.0), job.fetch_after_failure)

    if was_interrupted:
        error, status = "interrupted", 130
    elif hung is not None:
        failed, error, status = hung[0], hung[1], 1
    elif silent_s is not None:
        error, status = (f"no node printed anything for {silent_s:.0f} s, so the run was stopped "
                         f"(a node or a link hangs); see {job.run_dir / 'logs'}"), 1
    elif watched is not None and watched.lighthouse_ended:
        error, status = f"the quorum's lighthouse on {failed} ended", 1
    elif failed is not None:
        failed = _culprit(failed, outcomes)
        o = outcomes[failed]
        why = o.first_error or ("the SSH connection to it was lost" if o.exit_status in (255, None) else None)
        error = f"node {failed} failed (exit status {o.exit_status})" + (f": {why}" if why else "")
        status = 1
    else:
        status = 0
    if unclean:
        why = "; ".join(f"{r.node}: {r.error or f'pids {r.left} still running'}" for r in unclean)
        error = (error + "; " if error else "") + f"teardown could not verify every node ({why})"
        status = status or 1
    return LaunchResult(ok=status == 0, exit_status=status, run_dir=str(job.run_dir), rdzv_id=rdzv_id,
                        nodes=list(outcomes.values()), error=error, interrupted=was_interrupted,
                        stopped_by_job=was_interrupted and bool(by_job), ended_at=seen_at,
                        failed_node=failed, rank0_node=router.rank0_node, fetched=fetched,
                        lighthouse_ended=bool(watched and watched.lighthouse_ended),
                        lost_nodes=list(watched.lost) if watched else [],
                        lost_at=list(watched.lost_at) if watched else [],
                        back_nodes=list(watched.back) if watched else [],
                        back_at=list(watched.back_at) if watched else [],
                        first_sync_at=list(watched.first_sync_at) if watched else [],
                        **_joins(job, watched))


async def sync_items(job: Job, executors, states, synced: dict[str, dict[str, str]], outcomes, timeout_s: float) -> None:
    """The sync stage: every `job.syncs` item to every node in `executors`, by content hash (a node
    that holds them already gets nothing); where each landed goes into `synced[node][key]`. The
    launch's start and a node brought (back) into a running launch (`_quorum_rejoin`) both use it."""
    from vpscluster.launch.sync import sync_dir

    for item in job.syncs:
        files = local_files(item)
        if os.path.isdir(item.local_path) and not _all_local(job) and not _is_own_package(files.root):
            job.say(files.summary(f"sync {item.key}:"))  # what goes, and what was left out (secrets)
        root, manifest = files.root, files.manifest
        results = await asyncio.gather(*(
            sync_dir(ex, root, posixpath.join(states[ex.node.name].workdir, item.remote_rel),
                     timeout_s=max(timeout_s, 300.0), manifest=manifest, say=job.say,
                     detect_shared=job.detect_shared)
            for ex in executors))
        for r in results:
            synced.setdefault(r.node, {})[item.key] = _remote_of(item, r)
            outcomes[r.node].sync.append(r.to_dict())
        copied = [f"{r.node}: {r.changed} files" for r in results if not r.shared and r.changed]
        where = "every node" if len(executors) > 1 else executors[0].node.name
        job.say(f"sync {item.key}: " + (", ".join(copied) if copied else f"already in place on {where}"))


async def prepare_nodes(job: Job, executors, states, synced, timeout_s: float) -> None:
    """The prepare stage: each node's run dir, and what the job puts there (`job.prepare`)."""

    async def prepare(ex):
        st = states[ex.node.name]
        run_dir = job.node_run_dir(st.workdir)
        r = await ex.run(["mkdir", "-p", torchelastic_dir(job, st.workdir)], timeout_s=timeout_s)
        if not r.ok:
            raise RemoteError(f"node {ex.node.name}: cannot create {run_dir}: {r.reason()}")
        if job.prepare:
            await job.prepare(ex, st, synced[ex.node.name], run_dir)

    await asyncio.gather(*(prepare(ex) for ex in executors))


def _quorum_rejoin(job: Job, executors: list, by_name: dict, states, synced, outcomes, rdzv_id: str, port: int,
                   own_ports: dict[str, int], lighthouse_at: str, router, watched, start, timeout_s: float):
    """The quorum engine's `Rejoin` for this launch (None when `job.quorum.max_starts` is 0).

    A lost node that answers again goes through the launch's stages for that node alone —
    pre-flight (`pf.preflight`: reachable, workdir, firewall, interface), sync, prepare — so one
    that came back with a wiped disk gets its code, data and run configuration again; then what
    this launch left there is reaped (its workers, by launch id and VPSC_NODE; the head's
    lighthouse stays), and its command starts again on a fresh rendezvous port.

    A node added to the cluster file (launch/grow.py; only where the run has one) is checked as
    a new node (`grow.extended`, `grow.check_env`), goes through the same stages, and starts a
    new replica group (the next replica index); one that fails is dropped again, the job goes on."""
    from vpscluster.cluster.inventory import executor_for
    from vpscluster.launch import grow
    from vpscluster.launch import preflight as pf
    from vpscluster.launch.quorum import DRAIN_FILE, Rejoin, drain_watch, first_sync_watch, join_sync_watch
    from vpscluster.launch.recovery import ready
    from vpscluster.launch.teardown import reap_node

    if job.quorum.max_starts <= 0:
        return None
    planned = len(job.cluster.nodes)  # replica groups 0..planned-1 keep their data shards
    indexes = {n.name: i for i, n in enumerate(job.cluster.nodes)}  # an added node's: the next, once
    files = grow.ClusterFileWatch(job.cluster.source, job.known_nodes or [n.name for n in job.cluster.nodes]) \
        if job.cluster.source and not job.cluster.is_local else None

    retired: set[str] = set()  # drained nodes: put back in the file, they get a new replica index
    removed_now: list[str] = []  # the names `joiners()` found gone from the file, for `leavers()`

    def leavers() -> list[str]:
        gone = list(removed_now)
        removed_now.clear()
        return gone

    def drain_path(node: str) -> str:
        return posixpath.join(job.node_run_dir(states[node].workdir), DRAIN_FILE)

    async def drain(node: str) -> None:
        """Ask `node`'s replica group to leave at a sync: its drain file, created over SSH."""
        r = await by_name[node].run(["touch", drain_path(node)], timeout_s=timeout_s)
        if not r.ok:
            raise RemoteError(f"node {node}: cannot create {drain_path(node)}: {r.reason()}")
        router.note(node, f"removed from the cluster file: asked to drain ({drain_path(node)})")

    async def drained(node: str) -> None:
        """After `node` left: what this launch left there reaped, its drain file gone, the node
        forgotten by the launch (a node put back in the file joins as a new one)."""
        ex = by_name[node]
        if job.on_event is not None:  # the run's event stream (a detached run's progress.jsonl too)
            step = watched.drained_step[max(i for i, n in enumerate(watched.drained) if n == node)]
            job.on_event({"event": "node_drained", "node": node, "step": step, "reason": "removed from the cluster file"})
        reaped = await reap_node(ex, rdzv_id, grace_s=job.stop_grace_s or 6.0, this_node_only=True)
        await ex.run(["rm", "-f", drain_path(node)], timeout_s=timeout_s)
        job.cluster = dataclasses.replace(job.cluster, nodes=tuple(n for n in job.cluster.nodes if n.name != node))
        own_ports.pop(node, None)
        retired.add(node)
        if not reaped.clean:
            raise RemoteError(f"node {node}: what this launch left there is still running "
                              f"({reaped.error or f'pids {reaped.left}'}); teardown tries again at the end")

    async def answers(nodes: list[str]) -> list[str]:
        return await ready(job.cluster, nodes)

    async def bring_up(ex, on_line):
        node = ex.node.name
        # The launch's stages for this node: it may have come back with nothing on its disk.
        (st,) = (await pf.preflight(job.cluster, [ex], {node: states[node].facts}, timeout_s)).values()
        states[node] = st
        await sync_items(job, [ex], states, synced, outcomes, timeout_s)
        await prepare_nodes(job, [ex], states, synced, timeout_s)
        # A node cut off (not rebooted) may still run its old workers: stop them first.
        reaped = await reap_node(ex, rdzv_id, grace_s=job.stop_grace_s or 6.0, this_node_only=True)
        if not reaped.clean:
            raise RemoteError(f"what this launch left there is still running ({reaped.error or f'pids {reaped.left}'})")
        own_ports[node] = await pf.free_port(ex, st.address, timeout_s)
        (c,) = build_commands(job, states, synced, rdzv_id, port, own_ports, lighthouse_at, planned, only=node,
                              indexes=indexes)
        router.note(node, "$ " + c.shell())
        return await start(c, on_line)

    async def start_again(node: str):
        ex = by_name[node]
        if getattr(ex, "dark", lambda: False)():  # cut off earlier: every call would fail at once
            fresh = executor_for(ex.node, job.cluster)
            executors[executors.index(ex)] = by_name[node] = fresh  # closed and torn down with the rest
            ex = fresh
        router.note(node, "answers again: pre-flight and sync, then its replica group again (it heals from a peer)")
        return await bring_up(ex, drain_watch(watched, node, first_sync_watch(watched, node, router.for_node(node))))

    def added_nodes(cluster) -> list[tuple[Any, str | None]]:
        """(node, why it is refused or None) for each node new in the file (file reads and DNS:
        run off the event loop)."""
        out = []
        for node in files.new():
            try:
                grow.extended(cluster, node)
                out.append((node, None))
            except UserError as e:
                out.append((node, str(e)))
        return out

    async def joiners() -> list[tuple[str, float | None]]:
        names = []
        found = await asyncio.to_thread(added_nodes, job.cluster)
        removed_now.extend(files.removed())
        for node, refused in found:
            if refused:
                job.say(f"node {node.name} not added to the running job: {refused}")
                files.forget(node.name)
                continue
            # Its commands, and `ready` for it, see it from now on.
            job.cluster = dataclasses.replace(job.cluster, nodes=(*job.cluster.nodes, node))
            if node.name not in indexes or node.name in retired:  # new, or back after a drain: a fresh replica id
                indexes[node.name] = max(indexes.values()) + 1
                retired.discard(node.name)
            ex = executor_for(node, job.cluster)
            executors.append(ex)  # closed and torn down with the rest
            by_name[node.name] = ex
            outcomes[node.name] = NodeOutcome(node.name)
            router.add_node(node.name)
            states[node.name] = pf.NodeState(node.name, node.host, node.workdir)  # until its pre-flight
            names.append((node.name, files.changed_at))
        return names

    async def join(node: str):
        ex = by_name[node]
        try:
            router.note(node, "added to the cluster file: pre-flight, environment, sync, then a new replica group")
            facts = await grow.check_env(job.cluster, ex, [states[n].facts for n in states if n != node and states[n].facts])
            states[node].facts = facts
            return await bring_up(ex, drain_watch(watched, node, join_sync_watch(watched, node, router.for_node(node))))
        except BaseException:  # not added: the launch forgets it (its teardown would not reach it either)
            job.cluster = dataclasses.replace(job.cluster, nodes=tuple(n for n in job.cluster.nodes if n.name != node))
            for d in (states, synced, own_ports, by_name, outcomes):
                d.pop(node, None)
            executors.remove(ex)
            files.forget(node)
            await asyncio.shield(_close_quietly(ex))
            raise

    watching = files is not None
    return Rejoin(answers, start_again, job.quorum.rejoin_poll_s, job.quorum.max_starts,
                  joiners=joiners if watching else None, join=join if watching else None,
                  leavers=leavers if watching else None, drain=drain if watching else None,
                  drained=drained if watching else None, keep=files.keep if watching else None,
                  head=job.cluster.head, min_replicas=job.quorum.min_replicas)


async def _close_quietly(ex) -> None:
    try:
        await asyncio.wait_for(ex.close(), 10.0)
    except Exception:  # closing a connection to a node that failed its checks: nothing more to do
        pass


def _joins(job: Job, watched) -> dict[str, Any]:
    """The LaunchResult fields of the nodes added to, and drained from, the running job."""
    if watched is None:
        return {}
    drains = {"drained_nodes": list(watched.drained), "drained_at": list(watched.drained_at),
              "drained_step": list(watched.drained_step), "removed_nodes": list(watched.removed)}
    if not watched.joined:
        return drains
    return {**drains, "joined_nodes": list(watched.joined), "joined_at": list(watched.joined_at),
            "joined_file_at": list(watched.joined_file_at), "join_sync_at": list(watched.join_sync_at),
            "added": [n for n in job.cluster.nodes if n.name in set(watched.joined)]}


async def _quorum_ports(by_name, states, head, timeout_s: float) -> tuple[dict[str, int], int]:
    """A free port on every node for its own rendezvous, and another on the head for the lighthouse."""
    from vpscluster.launch import preflight as pf

    names = list(by_name)
    found = await asyncio.gather(*(pf.free_port(by_name[n], states[n].address, timeout_s) for n in names))
    own = dict(zip(names, found))
    for _ in range(5):  # free when asked, not reserved: not the one just given to the head's rendezvous
        port = await pf.free_port(head, states[head.node.name].address, timeout_s)
        if port != own[head.node.name]:
            return own, port
    raise RemoteError(f"node {head.node.name}: no second free port for the quorum's lighthouse")


async def _watch(handles, interrupted: asyncio.Event, router, silence_limits_s) -> tuple[str | None, bool, float | None]:
    """Wait for every node to finish; return at the first failure, interrupt or long silence:
    (failed node, interrupted, silent seconds)."""
    waits = {asyncio.ensure_future(h.wait()): h for h in handles}
    stop = asyncio.ensure_future(interrupted.wait())
    pending = set(waits)
    try:
        while pending:
            done, pending = await asyncio.wait(pending | {stop}, timeout=1.0, return_when=asyncio.FIRST_COMPLETED)
            pending.discard(stop)
            if stop in done:
                return None, True, None
            for t in done:
                if t.result() != 0:
                    return waits[t].node, False, None
            if silence_limits_s is not None:
                limit = silence_limits_s[1] if router.started else silence_limits_s[0]
                silent = time.monotonic() - router.last_line_at
                if silent > limit:
                    return None, False, silent
        return None, False, None
    finally:
        stop.cancel()
        for t in pending:
            t.cancel()


# Errors a node shows when *another* node died: the peer's own error says more.
_PEER_ERROR = re.compile(r"Connection closed by peer|Connection reset|Broken pipe|DistBackendError|"
                         r"DistNetworkError|NCCL communicator was aborted|Socket Timeout|SignalException", re.I)


def _culprit(first_failed: str, outcomes: dict[str, NodeOutcome]) -> str:
    """The node to blame: the first to fail, unless it only reports losing a peer that failed too."""
    for name in [first_failed] + [n for n in outcomes if n != first_failed]:
        o = outcomes[name]
        if o.exit_status not in (0, None) and o.first_error and not _PEER_ERROR.search(o.first_error):
            return name
    return first_failed


def local_side(item: SyncItem) -> tuple[str, dict[str, str]]:
    """(local root, manifest): a single file is its folder with a one-file manifest."""
    files = local_files(item)
    return files.root, files.manifest


def local_files(item: SyncItem):
    """The item as it is shipped (`sync.LocalFiles`): a folder less its caches and secrets, or
    a single file (named by the user, so sent whatever its name)."""
    from vpscluster.launch.sync import LocalFiles, file_hash, scan

    path = os.path.abspath(item.local_path)
    if os.path.isdir(path):
        return scan(path)
    if not os.path.isfile(path):
        raise UserError(f"{item.local_path}: no such file or folder to send to the nodes")
    return LocalFiles(os.path.dirname(path), {os.path.basename(path): file_hash(path)}, os.path.getsize(path), [], [])


def _is_own_package(root: str) -> bool:
    """vpscluster's own package folder (synced for every launch; not worth a line)."""
    import vpscluster

    return os.path.realpath(root) == os.path.realpath(os.path.dirname(vpscluster.__file__))


def _remote_of(item: SyncItem, result) -> str:
    if os.path.isdir(item.local_path):
        return result.remote_path
    return posixpath.join(result.remote_path, os.path.basename(item.local_path))


def _all_local(job: Job) -> bool:
    return all(n.local for n in job.cluster.nodes)


async def _fetch(ex, job: Job, workdir: str, timeout_s: float, names: list[str] | None = None) -> list[str]:
    fetched = []
    node_dir = job.node_run_dir(workdir)
    for name in job.fetch if names is None else names:
        remote = posixpath.join(node_dir, name)
        local = job.run_dir / name
        if ex.node.local and os.path.realpath(remote) == os.path.realpath(local):
            fetched.append(str(local))
            continue
        try:
            if job.fetch_optional:
                r = await ex.run(["test", "-f", remote], timeout_s=timeout_s)
                if not r.ok:
                    continue
            await ex.get(remote, str(local), timeout_s=timeout_s)
            fetched.append(str(local))
        except Exception as e:  # a missing report is reported by the caller, with the node's error
            job.say(f"{ex.node.name}: could not fetch {remote}: {e}")
    return fetched
