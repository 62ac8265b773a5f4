"""RunEvents reads rank 0's events from the run's node logs as they grow: only whole lines, only
what is new, in arrival order."""

from __future__ import annotations

from vpscluster.bench.run_events import RunEvents
from vpscluster.train.events import format_event


def test_events_are_read_as_the_logs_grow(tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()
    log = logs / "node-1.log"
    events = RunEvents(tmp_path)
    events.poll()
    assert events.step == 0 and events.seen == []
    with log.open("w") as f:
        f.write("node-1/0 stdout: " + format_event("start", world_size=3) + "\n")
        f.write("node-1/0 stdout: an ordinary line\n")
        f.write("[rank0]: " + format_event("step", step=1) + "\n")
        f.write("[rank0]: " + format_event("step", step=2)[:20])  # a line still being written
    events.poll()
    assert events.step == 1
    assert [e["world_size"] for _, e in events.since(0, "start")] == [3]
    with log.open("a") as f:
        f.write(format_event("step", step=2)[20:] + "\n")
    events.poll()
    assert events.step == 2
    assert [e["step"] for _, e in events.since(0, "step")] == [1, 2]  # nothing read twice
