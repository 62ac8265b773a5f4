"""Log and metrics writes on a full disk are dropped and counted, never raised (train/diskfull.py).

/dev/full answers every write with ENOSPC, as a node's filled disk does (the sandbox test with a
real full disk on rank 0's node: tests/test_launch_disk_full.py).
"""

from __future__ import annotations

import io
import json

import pytest


@pytest.fixture
def dropped(monkeypatch):
    from vpscluster.train import diskfull

    fresh = diskfull._Dropped()
    monkeypatch.setattr(diskfull, "DROPPED", fresh)
    return fresh


def test_the_rank_log_tee_drops_and_counts_what_a_full_disk_refuses(dropped, capfd):
    from vpscluster.train.diskfull import AppendFile
    from vpscluster.train.worker import _Tee

    shown = io.StringIO()
    tee = _Tee(shown, AppendFile("/dev/full"))
    print("warning: checkpoint failed; training goes on", file=tee, flush=True)
    print("step 2", file=tee, flush=True)
    assert shown.getvalue() == "warning: checkpoint failed; training goes on\nstep 2\n"  # the stream still gets it
    assert dropped.count == 2  # two lines (each print is two writes: the text, then the newline)
    warned = capfd.readouterr().err
    assert warned.count("dropped while the disk is full") == 1, warned  # one line, on the real stderr


def test_a_stream_on_a_full_disk_is_dropped_too(dropped, tmp_path):
    from vpscluster.train.diskfull import AppendFile
    from vpscluster.train.worker import _Tee

    full = open("/dev/full", "w", buffering=1)  # a rank's stdout redirected to a file on the full disk
    try:
        tee = _Tee(full, AppendFile(tmp_path / "rank-0.log"))
        print("VPSC_EVENT {}", file=tee, flush=True)
        assert (tmp_path / "rank-0.log").read_text() == "VPSC_EVENT {}\n"
        assert dropped.count >= 1
    finally:
        try:
            full.close()
        except OSError:  # its buffer still holds the line /dev/full refused
            pass


def test_metrics_lines_are_dropped_whole_and_the_file_goes_on(dropped, tmp_path):
    from vpscluster.train.diskfull import AppendFile
    from vpscluster.train.metrics import MetricsLog, read_metrics

    full = MetricsLog("/dev/full")
    full.log(step=1, loss=2.0)
    full.close()
    assert dropped.count == 1
    ok = MetricsLog(tmp_path / "metrics.jsonl")
    ok.log(step=1, loss=2.0)
    ok.close()
    assert read_metrics(tmp_path / "metrics.jsonl") == [{"step": 1, "loss": 2.0}]
    assert isinstance(ok._f, AppendFile) and json.loads((tmp_path / "metrics.jsonl").read_text())["step"] == 1
