"""`vpscluster stop RUN`: stop a run started with `train --detach` or `run --detach`, a checkpoint first.

SIGTERM to its launcher: every rank saves a checkpoint at the next step boundary, then every
process on every node is stopped. Past `--timeout` the launcher is killed (its node-side guards
still stop the workers). `vpscluster train|run --resume RUN_DIR` continues the run.
"""

from __future__ import annotations

import argparse

from vpscluster.cli.output import add_json_flag


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run", metavar="RUN", help="the run directory or run id `train --detach` or `run --detach` printed")
    parser.add_argument("--timeout", type=float, metavar="SECONDS",
                        help="kill the launcher if it has not stopped by then (default: the run's timeouts.stop_grace_s + 60)")
    add_json_flag(parser)


def run(args: argparse.Namespace) -> int:
    from vpscluster.cli.output import console, emit_json
    from vpscluster.errors import UserError
    from vpscluster.launch import detached

    run_dir = detached.find_run(args.run)
    if args.timeout is not None and args.timeout <= 0:
        raise UserError(f"--timeout {args.timeout:g}: give a positive number of seconds")
    timeout = args.timeout if args.timeout is not None else detached.stop_grace_s(run_dir) + 60.0
    out = console(args.json)
    state = detached.read_state(run_dir) or {}
    if state.get("controller"):  # the launcher runs on a node: stop it there (SIGTERM, as here)
        from vpscluster.launch import controller

        where = controller.launcher_state(state)
        if where not in ("running", "gone"):
            raise controller.no_answer(state, where)
        if where == "gone":
            raise UserError(f"run {run_dir} is not running: its launcher on {state['controller']} is gone (vpscluster "
                            f"attach {run_dir} shows how it ended); continue it with: "
                            f"{controller.continue_command(state, run_dir, state['controller'])} (or another node)")
        argv = ["stop", state["remote_run_dir"], "--timeout", f"{timeout:g}"] + (["--json"] if args.json else [])
        return controller.remote_cli(state, argv, timeout_s=timeout + 60.0)
    if not detached.running(state):
        raise UserError(f"run {run_dir} is not running ({detached.describe_end(state)}); "
                        f"continue it with: {detached.resume_command(run_dir)}")
    if not args.json:
        out.print(f"stopping {run_dir}: a checkpoint first (up to {timeout:.0f} s)")
    state = detached.stop(run_dir, timeout)
    doc = {"run_dir": str(run_dir), "forced": state["forced"], "exit_status": state.get("exit_status"),
           "message": state.get("message")}
    if args.json:
        emit_json(doc)
    else:
        how = "killed after the time-out (the nodes stop their workers themselves)" if state["forced"] else "stopped"
        out.print(f"{how}: {detached.describe_end(state)}")
    return 0
