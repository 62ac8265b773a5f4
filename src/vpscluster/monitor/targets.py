"""A run's rank exporters, handed to the cluster's Prometheus by an event subscriber.

The launchers (`launch/train.py`) know nothing of monitoring: they pass every event to the
`on_event` their caller gives, and end each launch with a `launch_ended` event. The CLI
subscribes this to the same stream:

    on_event = chain(view.handle, run_targets(cluster, run_dir.name, say))

- rank 0's `start` event names the ranks' exporters: they are added to Prometheus's file-based
  targets (`monitor/server.py: publish_run_targets`), on a thread, since the launch's event loop
  must not wait on a node;
- `launch_ended` (every launch, a relaunch after a lost node included) removes them: the next
  launch's `start` adds its own ranks.

Nothing happens when monitoring is not up (`monitor up` wrote no record for the cluster), and a
failure to publish is said in one line and never stops a run.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

from vpscluster.launch.pipeline import LAUNCH_ENDED
from vpscluster.monitor.server import load_record, publish_run_targets

OnEvent = Callable[[dict[str, Any]], None]


def run_targets(cluster, run_id: str, say: Callable[[str], None]) -> OnEvent:
    """The subscriber for one run (a no-op when the cluster has no Prometheus of ours)."""
    if cluster is None or load_record(cluster) is None:
        return lambda event: None

    def publish(exporters: list[dict]) -> None:
        try:
            where = publish_run_targets(cluster, run_id, exporters)
            say(f"monitoring: the run's {len(exporters)} rank exporters added to Prometheus ({where})")
        except Exception as e:  # monitoring must never stop a run
            say(f"monitoring: could not add the run's exporters to Prometheus: {e}")

    def on_event(event: dict[str, Any]) -> None:
        kind = event.get("event")
        if kind == "start" and event.get("exporters"):
            threading.Thread(target=publish, args=(event["exporters"],), name="vpsc-monitor-targets",
                             daemon=True).start()
        elif kind == LAUNCH_ENDED:
            try:
                publish_run_targets(cluster, run_id, [])
            except Exception as e:  # the run's outcome matters more than stale targets
                say(f"monitoring: could not remove the finished run's exporters from Prometheus: {e}")

    return on_event


def chain(*subscribers: OnEvent | None) -> OnEvent:
    """One subscriber that hands each event to every one given, in order."""
    live = [s for s in subscribers if s is not None]

    def on_event(event: dict[str, Any]) -> None:
        for s in live:
            s(event)

    return on_event
