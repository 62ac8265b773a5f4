"""Train the built-in GPT through the launch pipeline, on the local cluster or a cluster file.

    run = prepare_training(cfg)            # validates everything; creates and starts nothing
    report = launch_training(run, on_event=..., say=...)   # the run's report.json, as a dict
    train(cfg, ...)                        # both in one call, for Python users

Without a cluster file the job runs on the **local cluster**: one local node (this machine,
loopback address) running `cfg.nodes` ranks, through the same stages as a cluster of SSH nodes
(pre-flight, start, stream, teardown by launch id, silence watchdog, failure attribution), with
a c10d rendezvous on a free loopback port. The only differences are what being on this machine
makes unnecessary: nothing is copied (the package, the data and the run dir are already here)
and the run dir on the node is the launcher's own.

On a cluster file each node gets the vpscluster package source (synced by content hash to
`<workdir>/code/src/vpscluster`, put first on PYTHONPATH, so the nodes run the launcher's code
even where an older vpscluster is installed), the user's `--data` (to `<workdir>/data/`), and
its own `runs/<name>-<uid>/config.yaml` (the local run folder's name and the run's random
`run_uid`, `rundir.node_name`: a new run named as an older one gets a folder of its own) — the
run's configuration with `data` and `run_dir` rewritten to paths valid on that node. torchrun
then starts `python -m vpscluster.train.worker --run-dir runs/<name>-<uid>` from the node's workdir. Rank 0's
events go to `on_event`; report.json and metrics.jsonl are fetched from the node that ran rank 0
into the local run directory.

The run directory is created only once every node passed pre-flight (the pipeline's
`create_run`), so a refused command leaves nothing behind.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import posixpath
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from vpscluster.errors import Interrupted, RemoteError, UserError
from vpscluster.launch.commands import Program
from vpscluster.launch.logs import LOCAL_LOG
from vpscluster.launch.pipeline import LAUNCH_ENDED, Job, SyncItem
from vpscluster.launch.sync import PACKAGE_ON_NODE, package_dir
from vpscluster.train import rundir
from vpscluster.train.metrics import merge_launch, read_metrics, write_metrics
from vpscluster.train.strategies import AUTO, costs_for

FETCHED = [rundir.REPORT, rundir.METRICS]

Say = Callable[[str], None]
OnEvent = Callable[[dict], None]


def _quiet(_: Any) -> None:
    """The null sink: a library caller who passes no callback hears nothing."""


class TrainingFailed(RemoteError):
    """A rank or a node failed; the message names it, its first error and where the logs are."""


@dataclass
class TrainingRun:
    """A validated training run, ready to launch; nothing has been created or started yet."""

    cfg: Any  # TrainConfig, `run_dir` and the LR horizon fixed
    cluster: Any  # the cluster file's Cluster, or the local cluster
    run_dir: Path  # on this machine (created at launch, after pre-flight)
    resume: bool = False
    force: bool = False
    strategy_reason: str | None = None  # why `--strategy auto` chose what it chose, or diloco's planned settings
    speeds_note: str | None = None  # balancing by default (launch/balance.py), or where `--balance` starts from
    prediction: dict | None = None  # the plan's prediction for this run (train/prediction.py)
    auto: bool = False  # the strategy itself was chosen by `--strategy auto`

    def strategy_line(self, bold: bool = False) -> str | None:
        """"strategy auto -> NAME: reason" (or "strategy diloco: reason"), None when nothing was chosen."""
        if not self.strategy_reason:
            return None
        name = f"[bold]{self.cfg.strategy.name}[/]" if bold else self.cfg.strategy.name
        return f"strategy {'auto -> ' if self.auto else ''}{name}: {self.strategy_reason}"

    @property
    def local(self) -> bool:
        """Every node is this machine (the local cluster)."""
        return all(n.local for n in self.cluster.nodes)

    def recovery(self):
        """What the run does after a failure (launch/recovery.py `policy`: on by default on a cluster)."""
        from vpscluster.launch.recovery import policy

        return policy(self.cfg.recovery, len(self.cluster.nodes), self.local)


def prepare_training(cfg, *, resume_dir: str | os.PathLike | None = None, force: bool = False,
                     accept_new_host_keys: bool = False, insecure_network: bool = False,
                     given: "set[str] | None" = None) -> TrainingRun:
    """Check everything a run needs and resolve what is left open; create nothing.

    Loads the cluster file (or takes the local cluster), resolves `strategy auto` with the
    planner, sets DiLoCo's H, wire format and outer optimizer from the plan where the user did
    not (`train/strategies/sync_rule.py`; `given`: the strategy keys the user set, as the CLI knows them;
    None: those differing from the defaults), reads the data once (bad data fails here, in one
    line), fixes the LR schedule's horizon (so a later `--resume --max-steps` does not change it)
    and picks the run dir. A resumed run keeps its stored configuration as it is.
    """
    import dataclasses

    from vpscluster.train.data import load_dataset
    from vpscluster.train.presets import get_preset

    cfg = copy.deepcopy(cfg)
    cfg.validate(outer_steps=False)  # a TrainConfig built in Python has not been checked yet; H may be planned
    if cfg.cluster:
        from vpscluster.cluster.inventory import load_cluster

        cluster = load_cluster(cfg.cluster)
        if accept_new_host_keys:
            cluster = dataclasses.replace(cluster, accept_new_host_keys=True)
        if insecure_network:
            cluster = dataclasses.replace(cluster, insecure_network=True)
    else:
        from vpscluster.cluster.inventory import local_cluster

        cluster = local_cluster()
    n = len(cluster.nodes)
    if cfg.recovery.min_nodes > n:
        raise UserError(f"--min-nodes {cfg.recovery.min_nodes} is more than the {n} node{'s' if n != 1 else ''} "
                        f"of {'the cluster' if cfg.cluster else 'this machine (one local node)'}; give at most {n}")
    reason = None
    auto = cfg.strategy.name == AUTO
    if auto:
        from vpscluster.plan.auto import choose_for_training

        cfg.strategy, reason = choose_for_training(cfg, cluster if cfg.cluster else None, None, given)
        cfg.validate()
    elif costs_for(cfg.strategy.name).by_region and resume_dir is None:  # the regions, H and wire among them
        from vpscluster.plan.hierarchical import plan_for_training

        cfg.strategy = plan_for_training(cfg, cluster if cfg.cluster else None, given)
        cfg.validate()
        reason = cfg.strategy.launcher.planned_reason
    elif costs_for(cfg.strategy.name).planned_keys and resume_dir is None:  # DiLoCo's H and wire
        from vpscluster.plan.auto import given_keys, plan_diloco, plan_inputs

        model, res, eff = plan_inputs(cfg, cluster if cfg.cluster else None, None)
        cfg.strategy = plan_diloco(cfg, model, res, eff.value, given_keys(cfg.strategy) if given is None else given)
        cfg.validate()
        reason = cfg.strategy.launcher.planned_reason
    else:
        cfg.validate()
    load_dataset(cfg.data, get_preset(cfg.preset).seq_len, cfg.val_fraction)
    if cfg.strategy.quorum and resume_dir is None:  # the lighthouse's floor is the run's recovery floor
        from vpscluster.launch.quorum import quorum_floor

        cfg.strategy.quorum_min_replicas = quorum_floor(cfg.recovery, n, not cfg.cluster)
    speeds_note = None
    if resume_dir is None:
        speeds_note = balance_from_saved_probe(cfg, cluster) or starting_speeds(cfg, cluster)
        cfg.validate()  # the balanced split's settings (H, checkpoint interval) hold together
    if resume_dir is not None:
        run_dir = Path(resume_dir)
    else:
        cfg.lr_decay_steps = cfg.lr_decay_steps or cfg.max_steps
        cfg.lr = cfg.peak_lr()  # the preset's default written down: a resume keeps it
        run_dir = rundir.fresh_path(cfg.run_dir)
        cfg.run_dir = str(run_dir)
        cfg.run_uid = rundir.new_uid()  # a folder of its own on the nodes, whatever its name
    return TrainingRun(cfg=cfg, cluster=cluster, run_dir=run_dir, resume=resume_dir is not None,
                       force=force, strategy_reason=reason, speeds_note=speeds_note, auto=auto,
                       prediction=predict_run(cfg))


def ranks_per_node(cfg, cluster, gpus: dict[str, int] | None = None) -> dict[str, int] | None:
    """How many ranks each node runs: `--nodes` on the local cluster, `--nproc-per-node` on a
    cluster file, else one per GPU (`gpus`: per node, from the probe or pre-flight), at least one.
    None when that is not known yet (one per GPU and no GPU counts)."""
    if cfg.cluster is None:
        return {n.name: cfg.nodes for n in cluster.nodes}
    if cfg.nproc_per_node:
        return {n.name: cfg.nproc_per_node for n in cluster.nodes}
    if gpus is None or any(n.name not in gpus for n in cluster.nodes):
        return None
    return {n.name: max(1, gpus[n.name]) for n in cluster.nodes}


def _probe_gpus(probe: dict | None) -> dict[str, int] | None:
    if not probe:
        return None
    out = {}
    for n in probe.get("nodes") or []:
        if isinstance(n, dict) and n.get("name"):  # as pre-flight counts them (`NodeState.gpus`)
            out[n["name"]] = len(n.get("gpus") or []) if isinstance(n.get("gpus"), list) else 0
    return out


def check_speeds_count(cfg, ranks: dict[str, int] | None) -> None:
    """`--speeds` gives one figure per rank: refuse a wrong count before anything starts."""
    s = cfg.strategy
    if s.speeds is None or ranks is None:
        return
    world = sum(ranks.values())
    if len(s.speeds) != world:
        where = f"{len(ranks)} nodes x {', '.join(str(v) for v in sorted(set(ranks.values())))} ranks" \
            if len(set(ranks.values())) == 1 else " + ".join(f"{k}:{v}" for k, v in ranks.items())
        raise UserError(f"--speeds gives {len(s.speeds)} figures but this run has {world} ranks ({where}); "
                        f"give exactly {world}, one per rank")


def balance_from_saved_probe(cfg, cluster) -> str | None:
    """Balancing by default (`launch/balance.py`), decided from the cluster file's last saved
    probe when there is one; the one line to say, or None (undecided runs decide at pre-flight)."""
    from vpscluster.launch.balance import apply_default_balance, undecided
    from vpscluster.probe.store import load_probe

    if not cfg.cluster or not undecided(cfg):
        return None  # the local cluster: every rank on this machine, no per-node figures
    probe = load_probe(cluster)
    return apply_default_balance(cfg, probe, ranks_per_node(cfg, cluster, _probe_gpus(probe)))


def starting_speeds(cfg, cluster) -> str | None:
    """Check `--speeds` against the world size; for `--balance` without `--speeds`, start from
    the cluster's last probe (`strategy.launcher.node_speeds`: each node's FLOP/s, quota included, divided
    among its ranks). Returns the one line that says where the starting shares come from."""
    from vpscluster.probe.store import load_probe
    from vpscluster.train.shares import node_speeds_from_probe

    s = cfg.strategy
    if not s.micro_batches:
        return None
    probe = load_probe(cluster) if (s.speeds is None and s.balance and not s.launcher.node_speeds) or \
        (s.speeds is not None and cfg.cluster and not cfg.nproc_per_node) else None
    ranks = ranks_per_node(cfg, cluster, _probe_gpus(probe))
    check_speeds_count(cfg, ranks)
    if s.speeds is not None or not s.balance or s.launcher.node_speeds:
        return None
    if probe is None:
        return "balance: no probe of this cluster found; shares start even (run `vpscluster probe` to start from measured speeds)"
    speeds = node_speeds_from_probe(probe, ranks) if ranks else None
    if speeds is None:
        return "balance: the last probe does not measure every node's speed; shares start even (run `vpscluster probe` again)"
    s.launcher = dataclasses.replace(s.launcher, node_speeds=speeds)
    top = max(speeds.values())
    rel = ", ".join(f"{name} {v / top:.2f}" for name, v in speeds.items())
    return f"balance: shares start from the probe's speeds per rank ({rel}, relative to the fastest)"


def predict_run(cfg) -> dict | None:
    """The plan's prediction for this run (its strategy, nodes, batch, threads), for the ranks to
    compare with what they measure. Per-node compute comes from step times measured by
    `vpscluster plan --calibrate` when cached (plan/steptime.py), else the probe's FLOP/s; nothing
    is measured here. None (and the run goes on) when the planner cannot predict it."""
    from vpscluster.plan.api import PlanRequest, make_plan

    s = cfg.strategy
    if s.micro_batches:
        return None  # uneven shares: the plan predicts them (`balance`), the comparison does not yet
    try:
        doc = make_plan(PlanRequest(
            model=cfg.preset, cluster=cfg.cluster, strategy=s.name, batch_size=cfg.micro_batch(),
            nodes=None if cfg.cluster else cfg.nodes, compress=s.compress, powersgd_rank=s.powersgd_rank,
            bucket_mb=s.bucket_mb, sync_every=s.sync_every, wire_dtype=s.wire_dtype, fragments=s.fragments,
            threads_per_rank=cfg.threads_per_rank or None, tokens=1e6))
    except Exception:  # a prediction must never stop a run: a run the planner cannot model has none
        return None
    cal = doc.get("step_calibration") or {}
    source = f"step time {cal['source']}" if cal.get("covers_all") else f"FLOP/s x efficiency ({doc['efficiency']['source']})"
    return {key: doc[key] for key in ("label", "step_seconds", "compute_seconds", "comm_seconds", "tokens_per_step",
                                      "tokens_per_s", "world_size")} | {
        "compute_source": source, "nodes": [{"name": n["name"], "compute_seconds": n["compute_seconds"]} for n in doc["nodes"]]}


def backend_for(states) -> str:
    """NCCL only when every node has CUDA; one CPU node forces gloo for all."""
    return "nccl" if states and all(s.cuda and s.gpus > 0 for s in states.values()) else "gloo"


def training_job(cfg, run_dir: Path, cluster, *, resume: bool = False, force: bool = False,
                 rdzv_id: str | None = None, rdzv_port: int | None = None, say: Say = _quiet,
                 on_event: OnEvent | None = None, prediction: dict | None = None) -> Job:
    """The pipeline's job for this run (pure: touches no node and creates nothing)."""

    run_id = rundir.node_name(run_dir, cfg.run_uid)  # the run's folder on the nodes: runs/<run_id>
    here = all(n.local for n in cluster.nodes)
    syncs: list[SyncItem] = []
    if cfg.data and not os.path.exists(cfg.data):
        raise UserError(f"--data {cfg.data}: no such file or folder")
    if not here:  # nodes elsewhere need the package and the data; this machine has them
        syncs.append(SyncItem("code", package_dir(), PACKAGE_ON_NODE))
        if cfg.data:
            data = os.path.abspath(cfg.data)
            syncs.append(SyncItem("data", data, f"data/{os.path.basename(data)}" if os.path.isdir(data) else "data"))
    run_dir_on_node = _as_seen_here(run_dir, cluster) if here else None
    nproc = cfg.nodes if cfg.cluster is None else cfg.nproc_per_node
    from vpscluster.launch.quorum import quorum_launch

    # --quorum: one replica group per node, one rank each, a lighthouse on the head (as `run`'s)
    quorum, nproc = quorum_launch(cfg.strategy, cfg.recovery.rejoin_poll_s, nproc)

    def check_states(states) -> None:  # after pre-flight, before anything is created or started
        ranks = ranks_per_node(cfg, cluster, {n: st.gpus for n, st in states.items()})
        if not resume and cfg.cluster:  # balancing by default, from pre-flight's probe (launch/balance.py)
            from vpscluster.launch.balance import apply_default_balance

            line = apply_default_balance(cfg, {"nodes": [{**st.facts, "name": n} for n, st in states.items()]}, ranks)
            if line:
                cfg.validate()
                say(line)
        check_speeds_count(cfg, ranks)

    def program_for(states) -> Program:
        node_dir = run_dir_on_node or posixpath.join("runs", run_id)
        # Ranks on this machine pick their own backend (nccl when it has CUDA, as one machine).
        args = ["--run-dir", node_dir, "--backend", "auto" if here else backend_for(states)]
        return Program("module", "vpscluster.train.worker", tuple(args + (["--resume"] if resume else [])))

    from vpscluster.train.trainer import threads_per_rank

    # The ranks here share this machine's CPUs (cgroup quota included) unless the config says.
    threads = threads_per_rank(cfg.threads_per_rank, nproc or 1) if here else None

    def env_for(state, where) -> dict[str, str]:
        env = {"PYTHONPATH": posixpath.dirname(where["code"])} if "code" in where else {}
        if threads:  # also keeps torchrun from setting 1 and warning about it
            env["OMP_NUM_THREADS"] = str(threads)
        share, count = state.facts.get("cpu_share"), state.facts.get("cpu_count")
        if share and count and share < count:  # the node exporter's quota where no cgroup fs is visible
            from vpscluster.probe.node_exporter import QUOTA_ENV

            env[QUOTA_ENV] = str(share)
        return env

    async def prepare(ex, state, where, node_run_dir) -> None:
        from vpscluster.train.rundir import write_config

        if ex.node.local and os.path.realpath(node_run_dir) == os.path.realpath(run_dir):
            return  # the launcher's own config.yaml is this node's
        node_cfg = copy.deepcopy(cfg)
        node_cfg.run_dir = node_run_dir
        if "data" in where:
            node_cfg.data = where["data"]
        with tempfile.TemporaryDirectory(prefix="vpsc-cfg-") as tmp:
            local = write_config(node_cfg, tmp)
            try:
                await ex.put(str(local), posixpath.join(node_run_dir, "config.yaml"), timeout_s=120.0)
                if prediction is not None and not cfg.strategy.micro_batches:  # none for shares (predict_run)
                    from vpscluster import fsutil
                    from vpscluster.train.prediction import PREDICTION

                    fsutil.write_json(Path(tmp) / PREDICTION, prediction)
                    await ex.put(str(Path(tmp) / PREDICTION), posixpath.join(node_run_dir, PREDICTION), timeout_s=120.0)
            except Exception as e:
                raise RemoteError(f"node {ex.node.name}: could not write the run configuration: {e}") from None

    return Job(
        cluster=cluster, program=program_for({}), program_for=program_for, run_dir=Path(run_dir), run_id=run_id,
        syncs=syncs, cwd_key=None, nproc_per_node=nproc, fetch=list(FETCHED), fetch_after_failure=[rundir.METRICS],
        join_timeout_s=cfg.timeouts.rendezvous_s, store_timeout_s=cfg.timeouts.startup_collective_s,
        env_for=env_for, prepare=prepare, check_states=check_states, force=force, rdzv_id=rdzv_id, rdzv_port=rdzv_port,
        say=say, on_event=on_event, run_dir_on_node=run_dir_on_node, quorum=quorum,
        log_names={cluster.nodes[0].name: LOCAL_LOG} if cfg.cluster is None and len(cluster.nodes) == 1 else {},
        # Quiet for longer than the workers' own time-outs means a hang they cannot see.
        silence_limits_s=(cfg.timeouts.rendezvous_s + cfg.timeouts.startup_collective_s,
                          2 * cfg.timeouts.train_collective_s + 60),
        stop_grace_s=cfg.timeouts.stop_grace_s,  # the workers checkpoint before they stop
    )


def _as_seen_here(run_dir: Path, cluster) -> str:
    """The launcher's run dir as the local nodes see it: as given when they work in the current
    folder (so paths in the report read as the user wrote them), else absolute."""
    cwd = os.path.realpath(os.getcwd())
    same = all(os.path.realpath(os.path.expanduser(n.workdir)) == cwd for n in cluster.nodes)
    return str(run_dir) if same or os.path.isabs(run_dir) else os.path.abspath(run_dir)


def dry_run_training(run: TrainingRun) -> dict[str, Any]:
    """The exact per-node commands and environment of this run; runs and creates nothing."""
    from vpscluster.launch.pipeline import dry_run

    doc = dry_run(training_job(run.cfg, run.run_dir, run.cluster, resume=run.resume, force=run.force))
    plan = run.recovery()
    doc["recovery"] = {"max_restarts": plan.max_restarts, "min_nodes": plan.min_nodes, "nodes": plan.nodes,
                       "by_default": plan.by_default}
    doc["notes"] = [*doc.get("notes", []), plan.line(), *([run.speeds_note] if run.speeds_note else [])]
    return doc


def launch_training(run: TrainingRun, *, say: Say = _quiet, on_event: OnEvent | None = None) -> dict[str, Any]:
    """Run it to the end and return its report; `TrainingFailed` or `Interrupted` otherwise.

    One launcher per run: this process holds the run directory's lock (launch/runlock.py) from
    the start of a resume, or from the creation of a new run, until it returns; a second
    launcher is refused in one line naming this one. Failed launches are relaunched as
    `recovery` says (see `_launch_training`)."""
    from vpscluster.launch.runlock import RunLock

    lock = RunLock(run.run_dir)
    if run.resume:
        lock.acquire()
    try:
        return _launch_training(run, lock, say=say, on_event=on_event)
    finally:
        lock.release()


def _launch_training(run: TrainingRun, lock, *, say: Say, on_event: OnEvent | None) -> dict[str, Any]:
    """launch_training's body (`lock`: the run's, taken when a new run is created).

    The recovery supervisor (launch/supervisor.py) runs the launches: as `recovery.policy` says
    (on by default on a cluster of two or more nodes), a failed launch is relaunched from the
    last checkpoint on the nodes that still answer (at least its `min_nodes`), a relaunch that
    fails before it trains is relaunched again without the nodes at fault, and a node that is
    ready again is taken back; the report lists each in `recoveries`. What is `train`'s own is
    here: the run dir created once pre-flight passed, the metrics of launches on different
    heads merged. Each launch's end is an event (`LAUNCH_ENDED`) for the caller's subscribers
    (monitoring's targets: monitor/targets.py)."""
    from vpscluster.launch.supervisor import Supervisor

    created: list[bool] = []

    def create_run() -> None:
        if not run.resume and not created:
            rundir.create(run.run_dir)
            lock.acquire()
        created.append(True)
        rundir.write_config(run.cfg, run.run_dir)
        if run.prediction is not None and not run.cfg.strategy.micro_batches:  # pre-flight may have balanced it
            from vpscluster import fsutil
            from vpscluster.train.prediction import PREDICTION

            fsutil.write_json(run.run_dir / PREDICTION, run.prediction)

    history = read_metrics(run.run_dir / rundir.METRICS)  # every launch's metrics, merged (see _merge_metrics)
    plan = run.recovery()  # prepare_training checked --min-nodes against the cluster
    say(plan.line())
    sup = Supervisor(run.cluster, plan, rejoin_poll_s=run.cfg.recovery.rejoin_poll_s,
                     stop_grace_s=run.cfg.timeouts.stop_grace_s, resume=run.resume,
                     continue_with=f"vpscluster train --resume {run.run_dir} --cluster <a file of the nodes that answer>",
                     min_nodes_given=bool(run.cfg.recovery.min_nodes), say=say, failed=TrainingFailed)

    def make_job(cluster, resume: bool) -> Job:
        job = training_job(run.cfg, run.run_dir, cluster, resume=resume, force=run.force,
                           say=say, on_event=on_event, prediction=run.prediction)
        job.create_run = create_run
        return job

    def after_launch(result, resumed_from: int) -> None:
        nonlocal history
        if not run.local:
            history = _merge_metrics(run.run_dir / rundir.METRICS, history, result.fetched, resumed_from)
        if on_event is not None:  # subscribers (monitoring's targets) undo what the launch's start made them do
            on_event({"event": LAUNCH_ENDED})

    result = sup.run(make_job, after_launch)
    if result.interrupted:  # every process on every node has been stopped
        if sup.stopped_with_checkpoint:
            raise Interrupted(f"interrupted; checkpoint saved at step {sup.stop_checkpoint}, "
                              f"continue with: vpscluster train --resume {run.run_dir}")
        raise Interrupted()
    if not result.ok:
        _raise_failed(run, result)
    report = rundir.read_report(run.run_dir)
    if not run.local:
        # The worker wrote its node's path; here the run lives in the local run directory.
        report["node_run_dir"] = report.get("run_dir")
        report["run_dir"] = str(run.run_dir)
        report["rank0_node"] = result.rank0_node
    if sup.recoveries or plan.on:
        report["recoveries"] = sup.record()
        from vpscluster import fsutil

        fsutil.write_json(run.run_dir / rundir.REPORT, report)
    return report


def _merge_metrics(path: Path, history: list[dict[str, Any]], fetched: list[str], resumed_from: int) -> list[dict[str, Any]]:
    """Fold what one launch's rank 0 wrote (fetched to `path`, if its node answered) into the
    run's history and write the result to `path`: with recovery, rank 0 may run on another node
    in each launch, and each node's file holds only its own launches' lines."""
    if str(path) in fetched:
        history = merge_launch(history, read_metrics(path), resumed_from)
    if history:
        write_metrics(path, history)
    return history


def _raise_failed(run: TrainingRun, result) -> None:
    logs = run.run_dir / rundir.LOGS
    outcome = next((o for o in result.nodes if o.name == result.failed_node), None)
    if run.local and outcome is not None and outcome.first_error:
        raise TrainingFailed(f"training failed: {outcome.first_error}; logs in {logs}")
    where = f" on {run.cfg.cluster}" if run.cfg.cluster else ""
    raise TrainingFailed(f"training{where} failed: {result.error}; logs in {logs}")


def train(cfg, *, resume_dir: str | os.PathLike | None = None, force: bool = False,
          accept_new_host_keys: bool = False, say: Say = _quiet, on_event: OnEvent | None = None,
          insecure_network: bool = False) -> dict[str, Any]:
    """Train with `cfg` (a TrainConfig) on its cluster file or the local cluster; the report."""
    run = prepare_training(cfg, resume_dir=resume_dir, force=force, accept_new_host_keys=accept_new_host_keys,
                           insecure_network=insecure_network)
    if run.strategy_reason:
        say(run.strategy_line())
    if run.speeds_note:
        say(run.speeds_note)
    return launch_training(run, say=say, on_event=on_event)
