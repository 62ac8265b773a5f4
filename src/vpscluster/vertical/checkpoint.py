"""A stage's checkpoint: its weights, its optimizer and how many gradient steps they hold.

    save(path, model, opt, applied, counts=...)   # atomically: a kill leaves the previous one
    state = load(path)                            # None when there is none (a stage that died early)

A tower's holds `applied` (the steps it applied); the head's also the sample ids it trained on per
epoch (`counts`), so its report after a restart still counts every sample of the run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def path_of(out_dir: str | Path, stage: str) -> Path:
    return Path(out_dir) / f"checkpoint-{stage}.pt"


def save(path: Path, model, opt, applied: int, **extra: Any) -> None:
    """Weights and optimizer after `applied` steps (and `extra`: plain ints, floats, lists, dicts)."""
    import io

    import torch

    from vpscluster import fsutil

    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "applied": applied, **extra}, buf)
    path.parent.mkdir(parents=True, exist_ok=True)
    fsutil.write_atomic(path, buf.getvalue())


def load(path: Path) -> dict[str, Any] | None:
    import torch

    return torch.load(path, weights_only=True) if path.is_file() else None
