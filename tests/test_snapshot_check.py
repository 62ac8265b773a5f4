"""The snapshot helper itself: a missing snapshot fails (never a silent pass), an update writes it."""

from __future__ import annotations

import pytest

from snapshot_check import UPDATE_ENV, check_snapshot


def test_missing_snapshot_fails_and_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.delenv(UPDATE_ENV, raising=False)
    monkeypatch.delenv("CI", raising=False)  # on a laptop as in CI
    with pytest.raises(pytest.fail.Exception, match="snapshot .*new.json is missing; create it with VPSC_UPDATE_SNAPSHOTS=1"):
        check_snapshot("new.json", {"a": 1}, directory=tmp_path)
    assert list(tmp_path.iterdir()) == []
    monkeypatch.setenv("CI", "1")
    with pytest.raises(pytest.fail.Exception):
        check_snapshot("new.json", {"a": 1}, directory=tmp_path)


def test_update_writes_then_the_check_compares(tmp_path, monkeypatch):
    monkeypatch.setenv(UPDATE_ENV, "1")
    check_snapshot("s.json", {"b": [1, 2], "a": 1}, directory=tmp_path / "snaps")
    assert (tmp_path / "snaps" / "s.json").read_text() == '{\n  "a": 1,\n  "b": [\n    1,\n    2\n  ]\n}\n'
    monkeypatch.delenv(UPDATE_ENV)
    check_snapshot("s.json", {"a": 1, "b": [1, 2]}, directory=tmp_path / "snaps")
    with pytest.raises(AssertionError, match="s.json changed; if intended, regenerate with VPSC_UPDATE_SNAPSHOTS=1"):
        check_snapshot("s.json", {"a": 2, "b": [1, 2]}, directory=tmp_path / "snaps")
