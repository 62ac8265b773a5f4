"""`vpscluster train --cluster FILE`: the built-in trainer on every node of a cluster.

Each node gets the vpscluster package source (synced by content hash to
`<workdir>/code/src/vpscluster`, put first on PYTHONPATH, so the nodes run the launcher's code
even where an older vpscluster is installed), the user's `--data` (to `<workdir>/data/`), and
its own `runs/<run id>/config.yaml` — the run's configuration with `data` and `run_dir`
rewritten to paths valid on that node. torchrun then starts
`python -m vpscluster.train.worker --run-dir runs/<run id>` from the node's workdir. Rank 0's
events drive the progress view here; report.json and metrics.jsonl are fetched from the node
that ran rank 0 into the local run directory.
"""

from __future__ import annotations

import copy
import os
import posixpath
import tempfile
from pathlib import Path
from typing import Any

from vpscluster.errors import RemoteError, UserError
from vpscluster.launch.commands import Program
from vpscluster.launch.pipeline import Job, SyncItem

FETCHED = ["report.json", "metrics.jsonl"]


class ClusterTrainingFailed(RemoteError):
    """A node failed, or the launch was interrupted; the message names the node and its first error."""


def backend_for(states) -> str:
    """NCCL only when every node has CUDA; one CPU node forces gloo for all."""
    return "nccl" if states and all(s.cuda and s.gpus > 0 for s in states.values()) else "gloo"


def training_job(cfg, run_dir: Path, cluster, *, resume: bool = False, force: bool = False,
                 rdzv_id: str | None = None, rdzv_port: int | None = None, say=print, on_event=None) -> Job:
    import vpscluster

    run_id = Path(run_dir).name
    package_dir = os.path.dirname(os.path.abspath(vpscluster.__file__))
    syncs = [SyncItem("code", package_dir, "code/src/vpscluster")]
    if cfg.data:
        if not os.path.exists(cfg.data):
            raise UserError(f"--data {cfg.data}: no such file or folder")
        data = os.path.abspath(cfg.data)
        syncs.append(SyncItem("data", data, f"data/{os.path.basename(data)}" if os.path.isdir(data) else "data"))

    def program_for(states) -> Program:
        args = ["--run-dir", posixpath.join("runs", run_id), "--backend", backend_for(states)]
        return Program("module", "vpscluster.train.worker", tuple(args + (["--resume"] if resume else [])))

    def env_for(state, where) -> dict[str, str]:
        return {"PYTHONPATH": posixpath.dirname(where["code"])}

    async def prepare(ex, state, where, node_run_dir) -> None:
        from vpscluster.train.rundir import write_config

        node_cfg = copy.deepcopy(cfg)
        node_cfg.run_dir = node_run_dir
        if cfg.data:
            node_cfg.data = where["data"]
        with tempfile.TemporaryDirectory(prefix="vpsc-cfg-") as tmp:
            local = write_config(node_cfg, tmp)
            try:
                await ex.put(str(local), posixpath.join(node_run_dir, "config.yaml"), timeout_s=120.0)
            except Exception as e:
                raise RemoteError(f"node {ex.node.name}: could not write the run configuration: {e}") from None

    return Job(
        cluster=cluster, program=program_for({}), program_for=program_for, run_dir=Path(run_dir), run_id=run_id,
        syncs=syncs, cwd_key=None, nproc_per_node=cfg.nproc_per_node, fetch=list(FETCHED),
        join_timeout_s=cfg.timeouts.rendezvous_s, store_timeout_s=cfg.timeouts.startup_collective_s,
        env_for=env_for, prepare=prepare, force=force, rdzv_id=rdzv_id, rdzv_port=rdzv_port,
        say=say, on_event=on_event,
        # As for local runs: quiet for longer than the workers' own time-outs means a hang they cannot see.
        silence_limits_s=(cfg.timeouts.rendezvous_s + cfg.timeouts.startup_collective_s,
                          2 * cfg.timeouts.train_collective_s + 60),
    )


def launch_training(cfg, run_dir, args) -> dict[str, Any]:
    """Train across the cluster file's nodes; the report (as for local runs), or ClusterTrainingFailed."""
    import dataclasses

    from vpscluster.cli.output import console as make_console
    from vpscluster.cluster.inventory import load_cluster
    from vpscluster.launch.pipeline import launch
    from vpscluster.train.progress import ProgressView
    from vpscluster.train.rundir import read_report

    json_mode = bool(getattr(args, "json", False))
    cluster = load_cluster(cfg.cluster)
    if getattr(args, "accept_new_host_keys", False):
        cluster = dataclasses.replace(cluster, accept_new_host_keys=True)
    console = make_console(json_mode)
    with ProgressView(json_mode=json_mode, console=console) as view:
        job = training_job(
            cfg, Path(run_dir), cluster, resume=getattr(args, "resume", None) is not None,
            force=bool(getattr(args, "force", False)), say=view.log_line, on_event=view.handle,
        )
        result = launch(job)
    if result.interrupted:
        raise KeyboardInterrupt  # the CLI says "interrupted" and exits 130; every node was cleaned up
    if not result.ok:
        raise ClusterTrainingFailed(f"training on {cfg.cluster} failed: {result.error}; logs in {Path(run_dir) / 'logs'}")
    report = read_report(run_dir)
    # The worker wrote its node's path; here the run lives in the local run directory.
    report["node_run_dir"] = report.get("run_dir")
    report["run_dir"] = str(run_dir)
    report["rank0_node"] = result.rank0_node
    return report
