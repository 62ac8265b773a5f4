"""`vpscluster attach RUN`: follow a run started with `train --detach` or `run --detach` until it ends.

Prints the launcher's output (RUN_DIR/logs/detached.log) as it grows, and a line per step from
metrics.jsonl (at most one a second). Ends with the launcher's exit status once it is gone.
Ctrl-C detaches: the run goes on.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

POLL_S = 0.5
FOLLOW_S = 30 * 86400.0  # following a run on its controller node: at most this long per attach


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run", metavar="RUN", help="the run directory or run id `train --detach` or `run --detach` printed")


def run(args: argparse.Namespace) -> int:
    from vpscluster.launch import detached
    from vpscluster.launch.logs import FileTail

    run_dir = detached.find_run(args.run)
    state = detached.read_state(run_dir)
    if state and state.get("controller"):  # the launcher runs on a node: follow it there
        from vpscluster.launch import controller

        try:
            status = controller.remote_cli(state, ["attach", state["remote_run_dir"]], timeout_s=FOLLOW_S)
            if status != 0:  # the lines above name the run dir there; from here it goes on with:
                print(f"continue it from its newest checkpoint: {controller.continue_command(state, run_dir, state['controller'])} "
                      "(or another node)", file=sys.stderr)
            return status
        except KeyboardInterrupt:
            print(f"detached; the run goes on on {state['controller']} (vpscluster stop {run_dir} stops it)", file=sys.stderr)
            return 0
    log, metrics = FileTail(detached.log_path(run_dir)), FileTail(run_dir / "metrics.jsonl")
    last_step_shown = 0.0
    try:
        while True:
            state = detached.read_state(run_dir) or {}
            alive = detached.running(state)
            for line in log.lines():
                print(line, flush=True)
            steps = [d for d in map(_json, metrics.lines()) if d and d.get("loss") is not None]
            if steps and (time.monotonic() - last_step_shown >= 1.0 or not alive):
                s = steps[-1]
                print(f"step {s['step']}: loss {s['loss']:.4f} ({s.get('step_seconds', 0):.2f} s/step)", flush=True)
                last_step_shown = time.monotonic()
            if not alive:
                break
            time.sleep(POLL_S)
    except KeyboardInterrupt:
        print(f"detached; the run goes on (vpscluster stop {run_dir} stops it)", file=sys.stderr)
        return 0
    state = detached.read_state(run_dir) or {}
    status = state.get("exit_status")
    print(f"run {run_dir}: {detached.describe_end(state)}", file=sys.stderr)
    return int(status) if isinstance(status, int) else 1


def _json(line: str):
    try:
        return json.loads(line)
    except ValueError:
        return None
