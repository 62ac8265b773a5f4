"""`vpscluster run`: any torchrun-compatible script, unchanged, on every node of a cluster.

The script's directory (the current one, or `--sync DIR`) is synced to each node's workdir
under `code/run/<folder name>` (less caches and likely secrets: see `launch.sync`), the script runs from there with the node's own interpreter, and
torchrun gives it RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT as usual, so a
script written for `torchrun` on one machine (env:// init, DistributedSampler, DDP) needs no
change. Without a cluster file (`--nodes N`) the script runs as N processes here, from its
own folder, nothing copied.

For scripts that use the session API (`vpscluster.session`): the launcher writes the resolved
session settings (strategy, H, wire format, time budget, ...) to `session.json` in each node's
run dir and points `VPSC_SESSION` at it, as `train` writes config.yaml for its workers; nodes
elsewhere also get this vpscluster package (on PYTHONPATH). `report.json` and `metrics.jsonl`,
when the script's session wrote them, come back from rank 0's node. A script that does not use
the session API runs as before. `--strategy auto` adds the cluster's link figures and egress
quotas (`auto_inputs`); the session chooses on them and its model's measured steps (`session/auto.py`).
"""

from __future__ import annotations

import dataclasses
import os
import posixpath
import tempfile
import time
from pathlib import Path

from vpscluster.errors import RemoteError, UserError
from vpscluster.launch.commands import parse_program, relative_script
from vpscluster.launch.pipeline import Job, SyncItem
from vpscluster.launch.sync import PACKAGE_ON_NODE, package_dir
from vpscluster.train.strategies import STRATEGIES, costs_for

SESSION_FETCH = ("report.json", "metrics.jsonl")  # what a session writes on rank 0's node


def auto_inputs(cluster, local_ranks: int = 0):
    """`--strategy auto`: the link figures and egress quotas the session's choice needs
    (`session.config.AutoInputs`), from the cluster's last probe when `vpscluster probe` ran,
    else from the cluster file (`plan.resources.gather_resources`, as `train`'s plan takes
    them). `local_ranks` (`--nodes N`): N processes sharing this machine over loopback."""
    from vpscluster.plan.auto import egress_budget
    from vpscluster.plan.predict import ring_for
    from vpscluster.plan.resources import gather_resources
    from vpscluster.session.config import AutoInputs

    if local_ranks:
        res, source = gather_resources(None, None, nodes=local_ranks, local=True), "loopback"
    else:
        try:
            from vpscluster.probe.store import load_probe

            probe = load_probe(cluster)
        except ImportError:
            probe = None
        res = gather_resources(cluster, probe)
        source = "the last probe's link matrix" if probe else "the cluster file's bandwidths"
    ring = ring_for(res)
    egress = egress_budget(res)
    return AutoInputs(bandwidth_bytes_s=ring.beta_bytes_s, latency_s=ring.alpha_s,
                      egress_quotas=[list(q) for q in egress.quotas] if egress else [], source=source)


def with_quorum_floor(session, cluster, recovery_cfg):
    """`session` (a SessionConfig) with `--quorum`'s lighthouse floor set for the run on the
    whole `cluster` (`quorum.quorum_floor`, as `train` sets it); unchanged without --quorum."""
    if session is None or not session.strategy.quorum:
        return session
    from vpscluster.launch.quorum import quorum_floor

    floor = quorum_floor(recovery_cfg, len(cluster.nodes), all(n.local for n in cluster.nodes))
    return dataclasses.replace(session, strategy=dataclasses.replace(session.strategy, quorum_min_replicas=floor))


def check_quorum_script(program, root: str, nproc_per_node: int, in_place: bool) -> None:
    """`run --quorum`'s refusals, one line each: the local processes of `--nodes N` (one node:
    one replica group), more than one rank per node, and a script not on the session API (it
    would train alone on every node: `script_hints.quorum_refusal`)."""
    from vpscluster.launch.script_hints import module_file, quorum_refusal

    if in_place:
        raise UserError("--quorum trains one replica group per node of a cluster file: give --cluster FILE instead "
                        "of --nodes N (this machine's processes are one node, one group), or leave --quorum out")
    if nproc_per_node > 1:
        raise UserError(f"--quorum runs one rank per node for now (its replica group); drop --nproc-per-node "
                        f"{nproc_per_node} or leave --quorum out")
    path = os.path.join(root, program.target) if program.kind == "script" else \
        module_file(program.target, root) if program.kind == "module" else None
    line = quorum_refusal(path, [root]) if path else None  # a program of another kind: nothing to read
    if line:
        raise UserError(line)


def script_job(cluster, argv: list[str], *, sync: str | None = None, run_dir: str | None = None,
               nproc_per_node: int = 0, force: bool = False, rdzv_id: str | None = None,
               rdzv_port: int | None = None, join_timeout_s: float = 600.0, say=print,
               session=None, in_place: bool = False, rejoin_poll_s: float = 10.0) -> Job:
    """The job for `argv` on `cluster`; `session`: the resolved `session.config.SessionConfig`
    handed to the script's `session.start()` (None: the defaults). `in_place` (`--nodes N`, a
    cluster of this machine): run from the script's folder, nothing copied. With
    `session.strategy.quorum` (`--quorum`, its floor set by `with_quorum_floor`): the quorum
    engine's launch, as `train --quorum`'s (`quorum.quorum_launch`: a lighthouse on the head,
    one replica group per node; `rejoin_poll_s`: how often a lost node is asked whether it
    answers again)."""
    from vpscluster.launch.quorum import quorum_launch
    from vpscluster.session.config import ENV, FILE, SessionConfig

    root = os.path.abspath(sync or os.getcwd())
    if not os.path.isdir(root):
        raise UserError(f"--sync {sync}: not a folder")
    program = relative_script(parse_program(argv), root)
    if program.kind == "script" and not os.path.isfile(os.path.join(root, program.target)):
        raise UserError(f"{program.target}: no such script in {root}; run from its folder or pass --sync DIR")
    if session is not None and session.strategy.quorum:
        check_quorum_script(program, root, nproc_per_node, in_place)
    run_id = "run-" + time.strftime("%Y%m%d-%H%M%S", time.gmtime()) + "-" + os.urandom(3).hex()
    local_run_dir = Path(run_dir) if run_dir else Path("runs") / run_id
    if run_dir:
        run_id = Path(run_dir).name
    here = all(n.local for n in cluster.nodes)
    given = session or SessionConfig()  # decided in place (balancing by default): a relaunch keeps the split
    balancing = not in_place and len(cluster.nodes) > 1  # this machine's ranks have no per-node figures
    if balancing:
        decide_balance(given, cluster, nproc_per_node, None, say)

    def resolved(session):
        s = session.strategy
        if s.name in STRATEGIES and costs_for(s.name).by_region and s.regions is None and not s.launcher.node_regions:
            # Each rank looks up its node's region (`train/strategies/hierarchical.py`): from the
            # cluster file's labels.region, else the last probe's regions.
            from vpscluster.plan.hierarchical import cluster_regions, saved_probe

            regions = cluster_regions(cluster, saved_probe(cluster))
            if regions:
                session = dataclasses.replace(session, strategy=s.with_launcher(node_regions=regions))
        if session.strategy.name == "auto" and session.auto is None:
            session = dataclasses.replace(session, auto=auto_inputs(cluster, nproc_per_node if in_place else 0))
        return session

    session = resolved(given)

    def check_states(states) -> None:  # after pre-flight, before anything is written to the nodes
        nonlocal session
        if balancing and decide_balance(given, cluster, nproc_per_node, states, say):
            session = resolved(given)

    threads = None
    if in_place:  # this machine: the script runs from its own folder; nothing is copied
        if not here:
            raise ValueError("in_place needs a cluster of this machine")
        cluster = dataclasses.replace(cluster, nodes=tuple(dataclasses.replace(n, workdir=root) for n in cluster.nodes))
        syncs, cwd_key = [], None
        run_dir_on_node = str(local_run_dir.resolve())
        from vpscluster.train.trainer import threads_per_rank

        threads = threads_per_rank(None, nproc_per_node or 1)  # the ranks share this machine's CPUs, as train's
    else:
        name = os.path.basename(root.rstrip("/")) or "root"
        # code/run/<name>: beside the package's code/src/vpscluster (a folder named "src" must not land on it)
        syncs = [SyncItem("code", root, f"code/run/{name}")]
        if not here:  # nodes elsewhere need this package for `from vpscluster import session`
            syncs.append(SyncItem("vpscluster", package_dir(), PACKAGE_ON_NODE))
        cwd_key, run_dir_on_node = "code", None
    job: Job

    def env_for(state, where) -> dict[str, str]:
        env = {ENV: posixpath.join(job.node_run_dir(state.workdir), FILE)}
        if "vpscluster" in where:
            env["PYTHONPATH"] = posixpath.dirname(where["vpscluster"])
        if session.threads_per_rank or threads:  # the user's --threads-per-rank, else this machine's share
            env["OMP_NUM_THREADS"] = str(session.threads_per_rank or threads)
        return env

    async def prepare(ex, state, where, node_run_dir) -> None:
        from vpscluster.session.config import write

        node_cfg = dataclasses.replace(session, run_dir=node_run_dir)
        if ex.node.local:
            write(node_cfg, node_run_dir)
            return
        with tempfile.TemporaryDirectory(prefix="vpsc-session-") as tmp:
            try:
                await ex.put(str(write(node_cfg, tmp)), posixpath.join(node_run_dir, FILE), timeout_s=120.0)
            except Exception as e:
                raise RemoteError(f"node {ex.node.name}: could not write the session settings: {e}") from None

    quorum, nproc_per_node = quorum_launch(session.strategy, rejoin_poll_s, nproc_per_node)
    job = Job(
        cluster=cluster, program=program, run_dir=local_run_dir, run_id=run_id, quorum=quorum,
        syncs=syncs, cwd_key=cwd_key, nproc_per_node=nproc_per_node, join_timeout_s=join_timeout_s,
        store_timeout_s=min(300.0, join_timeout_s), force=force, rdzv_id=rdzv_id, rdzv_port=rdzv_port, say=say,
        env_for=env_for, prepare=prepare, check_states=check_states, run_dir_on_node=run_dir_on_node, fetch=list(SESSION_FETCH), fetch_optional=True,
        stop_grace_s=session.timeouts.stop_grace_s,  # a session checkpoints before it stops
    )
    return job


def decide_balance(session, cluster, nproc_per_node: int, states, say) -> bool:
    """Balancing by default for a session (`launch/balance.py`, train's decision): from the
    cluster's last saved probe (`states` None), else from pre-flight's probe of each node
    (`states`: pre-flight's NodeStates). Changes `session` in place, says the line; True when
    it decided now."""
    from vpscluster.launch.balance import apply_default_balance, undecided

    if not undecided(session):
        return False
    if states is None:
        from vpscluster.launch.train import _probe_gpus
        from vpscluster.probe.store import load_probe

        probe = load_probe(cluster)
        gpus = _probe_gpus(probe)
    else:
        probe = {"nodes": [{**st.facts, "name": n} for n, st in states.items()]}
        gpus = {n: st.gpus for n, st in states.items()}
    if nproc_per_node:
        ranks = {n.name: nproc_per_node for n in cluster.nodes}
    elif gpus is None or any(n.name not in gpus for n in cluster.nodes):
        return False  # one rank per GPU, not counted yet: pre-flight decides
    else:
        ranks = {n.name: max(1, gpus[n.name]) for n in cluster.nodes}
    line = apply_default_balance(session, probe, ranks)
    if line:
        session.validate()
        say(line)
    return not undecided(session)


def recovery_policy(cluster, recovery_cfg):
    """The run's `recovery.Policy` (`--max-restarts`, `--min-nodes` as train's: on by default on a
    cluster of two or more nodes, off on this machine); a `--min-nodes` above the nodes is refused."""
    from vpscluster.launch.recovery import policy

    n = len(cluster.nodes)
    local = all(node.local for node in cluster.nodes)
    if recovery_cfg.min_nodes > n:
        raise UserError(f"--min-nodes {recovery_cfg.min_nodes} is more than the {n} node{'s' if n != 1 else ''} "
                        f"of {'this machine (one local node)' if local else 'the cluster'}; give at most {n}")
    return policy(recovery_cfg, n, local)


def launch_script(cluster, argv: list[str], *, recovery_cfg, session=None, say=print, in_place: bool = False,
                  **job_args):
    """Run `argv` on `cluster` to the end, relaunched after failures as `recovery_cfg` (a
    `train.config.RecoveryConfig`: `--max-restarts`, `--min-nodes`) and `recovery.policy` say —
    the same supervisor as `train` (launch/supervisor.py). A relaunch starts the script again
    with the session's `resume` on: its `session.resume(optimizer)` continues from the newest
    checkpoint in the run dir (re-cut for the ranks present; a node without one receives it from
    a holder). A failure while every node still answers is relaunched only when the launch saved
    a checkpoint (else the script's own error would just come again). Returns (the last launch's LaunchResult, the Supervisor: its `recoveries`);
    `job_args`: `script_job`'s other keywords (sync, run_dir, nproc_per_node, ...)."""
    from vpscluster.launch.supervisor import Supervisor
    from vpscluster.session.config import SessionConfig
    from vpscluster.train import rundir
    from vpscluster.train.metrics import merge_launch, read_metrics, write_metrics

    session = with_quorum_floor(session or SessionConfig(), cluster, recovery_cfg)
    plan = recovery_policy(cluster, recovery_cfg)
    local = plan.local
    job_args["rejoin_poll_s"] = recovery_cfg.rejoin_poll_s
    first = script_job(cluster, argv, session=session, say=say, in_place=in_place, **job_args)
    job_args["run_dir"] = str(first.run_dir)  # every launch runs in the first one's run dir (its checkpoints)
    say(plan.line())
    continue_with = (f"vpscluster run --resume {first.run_dir} --cluster <a file of the nodes that answer> -- "
                     + " ".join(argv))
    sup = Supervisor(cluster, plan, rejoin_poll_s=recovery_cfg.rejoin_poll_s, stop_grace_s=session.timeouts.stop_grace_s,
                     resume=session.resume, continue_with=continue_with, min_nodes_given=bool(recovery_cfg.min_nodes),
                     say=say, retry_without_progress=False)

    unused = [first]  # the first launch's job, built above (its checks refuse a bad command before the line)

    def make_job(part, resume: bool):
        job = unused.pop() if unused else script_job(
            part, argv, session=dataclasses.replace(session, resume=session.resume or resume), say=say,
            in_place=in_place, **job_args)
        if plan.on:
            job.fetch_after_failure = [rundir.METRICS]  # what rank 0 trained before the failure
        return job

    metrics_path = first.run_dir / rundir.METRICS
    history = read_metrics(metrics_path) if session.resume else []

    def after_launch(result, resumed_from: int) -> None:
        nonlocal history
        if local or not plan.on:
            return  # rank 0 wrote into this run dir itself, or one launch: its file as fetched
        if str(metrics_path) in result.fetched:
            history = merge_launch(history, read_metrics(metrics_path), resumed_from)
        if history:
            write_metrics(metrics_path, history)

    result = sup.run(make_job, after_launch)
    report_path = first.run_dir / rundir.REPORT
    if result.ok and (sup.recoveries or plan.on) and report_path.is_file():
        from vpscluster import fsutil

        report = rundir.read_report(first.run_dir)
        report["recoveries"] = sup.record()
        fsutil.write_json(report_path, report)
    return result, sup
