"""`vpscluster run`: any torchrun-compatible script, unchanged, on every node of a cluster.

The script's directory (the current one, or `--sync DIR`) is synced to each node's workdir
under `code/<folder name>` (less caches and likely secrets: see `launch.sync`), the script runs from there with the node's own interpreter, and
torchrun gives it RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT as usual, so a
script written for `torchrun` on one machine (env:// init, DistributedSampler, DDP) needs no
change.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from vpscluster.errors import UserError
from vpscluster.launch.commands import parse_program, relative_script
from vpscluster.launch.pipeline import Job, SyncItem


def script_job(cluster, argv: list[str], *, sync: str | None = None, run_dir: str | None = None,
               nproc_per_node: int = 0, force: bool = False, rdzv_id: str | None = None,
               rdzv_port: int | None = None, join_timeout_s: float = 600.0, say=print) -> Job:
    root = os.path.abspath(sync or os.getcwd())
    if not os.path.isdir(root):
        raise UserError(f"--sync {sync}: not a folder")
    program = relative_script(parse_program(argv), root)
    if program.kind == "script" and not os.path.isfile(os.path.join(root, program.target)):
        raise UserError(f"{program.target}: no such script in {root}; run from its folder or pass --sync DIR")
    run_id = "run-" + time.strftime("%Y%m%d-%H%M%S", time.gmtime()) + "-" + os.urandom(3).hex()
    local_run_dir = Path(run_dir) if run_dir else Path("runs") / run_id
    if run_dir:
        run_id = Path(run_dir).name
    name = os.path.basename(root.rstrip("/")) or "root"
    return Job(
        cluster=cluster, program=program, run_dir=local_run_dir, run_id=run_id,
        syncs=[SyncItem("code", root, f"code/{name}")], cwd_key="code",
        nproc_per_node=nproc_per_node, join_timeout_s=join_timeout_s,
        store_timeout_s=min(300.0, join_timeout_s), force=force, rdzv_id=rdzv_id, rdzv_port=rdzv_port, say=say,
    )
