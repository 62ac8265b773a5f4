"""`check_snapshot`: the one snapshot helper of the suite.

A snapshot is a JSON file under tests/snapshots/ that holds what a command printed. A test
fails when the output differs from it, and also when the snapshot is missing: a deleted or never
committed snapshot must not turn the check into a silent pass. After an intended change (or to
create a new snapshot), regenerate and commit:

    VPSC_UPDATE_SNAPSHOTS=1 .venv/bin/pytest tests/test_launch_commands.py tests/test_train_launch.py
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

SNAPSHOTS = Path(__file__).parent / "snapshots"
UPDATE_ENV = "VPSC_UPDATE_SNAPSHOTS"


def check_snapshot(name: str, doc, directory: Path = SNAPSHOTS) -> None:
    """`doc` (as sorted, indented JSON) must equal snapshot `name`; with VPSC_UPDATE_SNAPSHOTS=1
    the snapshot is (re)written instead."""
    path = Path(directory) / name
    text = json.dumps(doc, indent=2, sort_keys=True) + "\n"
    if os.environ.get(UPDATE_ENV) == "1":
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        return
    if not path.exists():
        pytest.fail(f"snapshot {path} is missing; create it with {UPDATE_ENV}=1 and commit it", pytrace=False)
    assert text == path.read_text(), f"{name} changed; if intended, regenerate with {UPDATE_ENV}=1"
