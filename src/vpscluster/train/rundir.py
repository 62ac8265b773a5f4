"""The run directory: where one training run keeps everything.

    runs/<run-id>/            (or --run-dir DIR; run id = UTC timestamp + short random suffix)
      config.yaml             the resolved TrainConfig (defaults < --config < flags)
      metrics.jsonl           a line per step and per evaluation (rank 0)
      checkpoints/            step-NNNNNNNN/ with one shard per rank and a manifest
      logs/                   each rank's output (rank-N.log), the launcher's (launcher.log; on a
                              cluster <node>.log), torchrun's own (torchelastic/)
      report.json             the run report (contract keys, see train/report.py)
"""

from __future__ import annotations

import json
import secrets
import time
from pathlib import Path
from typing import Any

from vpscluster import fsutil
from vpscluster.errors import UserError

CONFIG = "config.yaml"
METRICS = "metrics.jsonl"
REPORT = "report.json"
CHECKPOINTS = "checkpoints"
LOGS = "logs"


def new_run_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S", time.gmtime()) + "-" + secrets.token_hex(3)


def new_uid() -> str:
    """A new run's `run_uid`: keys its folder on the nodes (`node_name`)."""
    return secrets.token_hex(4)


def node_name(run_dir: str | Path, run_uid: str) -> str:
    """The run's folder name under runs/ on the nodes: the local folder's name and the run's
    `run_uid` (a run made before run_uid existed: the folder's name alone, as it was then)."""
    name = Path(run_dir).name
    return f"{name}-{run_uid}" if run_uid else name


def fresh_path(run_dir: str | Path | None, base: str | Path = "runs") -> Path:
    """Where a new run goes (`run_dir`, or base/<new run id>), refused if a run is there; creates nothing."""
    d = Path(run_dir) if run_dir else Path(base) / new_run_id()
    if (d / CONFIG).exists():
        raise UserError(f"--run-dir {d} already holds a run; continue it with --resume {d} or pick a new folder")
    if d.exists() and not d.is_dir():
        raise UserError(f"--run-dir {d} is a file; pick a folder")
    return d


def create(run_dir: str | Path | None, base: str | Path = "runs") -> Path:
    """Make a fresh run directory (and its logs/ and checkpoints/)."""
    d = fresh_path(run_dir, base)
    try:
        for sub in (LOGS, CHECKPOINTS):
            (d / sub).mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"--run-dir {d}: cannot create it ({e.strerror})") from None
    return d


def find(ref: str | Path, base: str | Path = "runs") -> Path:
    """A run named by its directory or by its run id under `base`; one-line error otherwise."""
    for d in (Path(ref), Path(base) / ref):
        if (d / CONFIG).is_file() or (d / LOGS).is_dir():
            return d
    raise UserError(f"no run {str(ref)!r}: give a run directory or a run id under {base}/ "
                    "(train prints it at the start)")


def write_config(cfg: Any, run_dir: str | Path) -> Path:
    import yaml

    from vpscluster.config import to_dict

    return fsutil.write_atomic(Path(run_dir) / CONFIG, yaml.safe_dump(to_dict(cfg), sort_keys=False))


def read_config(run_dir: str | Path):
    from vpscluster.config import build, load_yaml
    from vpscluster.train.config import TrainConfig

    p = Path(run_dir) / CONFIG
    if not p.exists():
        raise UserError(f"{run_dir}: not a run directory (no {CONFIG}); give the folder a run was started in")
    return build(TrainConfig, load_yaml(p, "run config"), str(p))


def read_report(run_dir: str | Path) -> dict[str, Any]:
    p = Path(run_dir) / REPORT
    try:
        return json.loads(p.read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"{p}: no readable report ({e}); see {Path(run_dir) / LOGS}") from None
