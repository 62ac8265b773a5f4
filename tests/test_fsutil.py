"""fsutil.write_atomic / write_json: a reader sees the old file or the new one, nothing left behind."""

from __future__ import annotations

import json
import multiprocessing
import os
from pathlib import Path

import pytest

from vpscluster import fsutil


def test_write_replaces_text_bytes_and_json(tmp_path: Path) -> None:
    p = tmp_path / "f.txt"
    assert fsutil.write_atomic(p, "first\n") == p and p.read_text() == "first\n"
    fsutil.write_atomic(p, b"\x00second")
    assert p.read_bytes() == b"\x00second"
    fsutil.write_json(p, {"a": [1, 2]})
    assert p.read_text() == json.dumps({"a": [1, 2]}, indent=2) + "\n"
    assert sorted(x.name for x in tmp_path.iterdir()) == ["f.txt"]  # no temporary file left


def test_failed_write_keeps_the_old_file_and_removes_the_temporary(tmp_path: Path) -> None:
    p = tmp_path / "doc.json"
    fsutil.write_json(p, {"v": 1})
    with pytest.raises(TypeError):
        fsutil.write_atomic(p, 12)  # type: ignore[arg-type]  # not text nor bytes: fails mid-write
    assert json.loads(p.read_text()) == {"v": 1}
    assert sorted(x.name for x in tmp_path.iterdir()) == ["doc.json"]
    with pytest.raises(FileNotFoundError):
        fsutil.write_atomic(tmp_path / "missing" / "x", "a")  # the folder must exist


def _writer(path: str, rounds: int) -> None:
    for i in range(rounds):
        fsutil.write_json(Path(path), {"i": i, "pad": "x" * 200_000})


def test_a_concurrent_reader_never_sees_half_a_file(tmp_path: Path) -> None:
    p = tmp_path / "live.json"
    fsutil.write_json(p, {"i": -1, "pad": ""})
    writer = multiprocessing.get_context("spawn").Process(target=_writer, args=(str(p), 40))
    writer.start()
    seen = set()
    try:
        while writer.is_alive() or not seen:
            seen.add(json.loads(p.read_text())["i"])  # a torn read would raise here
    finally:
        writer.join(60)
    assert writer.exitcode == 0 and json.loads(p.read_text())["i"] == 39
    assert not [x for x in os.listdir(tmp_path) if x != "live.json"]
