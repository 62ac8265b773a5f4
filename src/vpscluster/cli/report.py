"""`vpscluster report RUN_DIR`: write RUN_DIR/report.html, one self-contained file (opens offline).

While a detached run still goes (no metrics.jsonl in its run dir yet), prints its progress so far
instead, one line, from what its launcher records as rank 0 reports it (progress.jsonl); for a run
whose launcher is on a controller node, that record is fetched from there first."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", metavar="RUN_DIR", help="a training run directory (holds metrics.jsonl)")


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from vpscluster.launch import controller, detached
    from vpscluster.monitor.report import write_report
    from vpscluster.train import rundir

    run_dir = Path(args.run_dir)
    state = detached.read_state(run_dir)
    if controller.is_remote(state):  # written on the controller node, from its run dir; fetched here
        where = controller.launcher_state(state)
        if where not in ("running", "gone"):
            raise controller.no_answer(state, where)
        if where == "running":
            controller.fetch(run_dir, state, names=(detached.PROGRESS,))
            return _in_progress(run_dir, f"on {state['controller']}")
        status = controller.remote_cli(state, ["report", state["remote_run_dir"]], timeout_s=600.0, on_line=_stderr_only)
        got = controller.fetch(run_dir, state, names=controller.FETCHED + (detached.PROGRESS,))
        if status != 0 or "report.html" not in got:
            from vpscluster.errors import RemoteError

            raise RemoteError(f"the controller node {state['controller']} could not write the report (exit status "
                              f"{status}); see vpscluster logs {args.run_dir}")
        print(run_dir / "report.html")
        return 0
    if not (run_dir / rundir.METRICS).exists() and detached.running(state or {}):
        return _in_progress(run_dir, "")
    print(write_report(run_dir))
    return 0


def _in_progress(run_dir, where: str) -> int:
    """The one line of a run that still goes; report.html comes at its end."""
    from vpscluster.launch import detached

    line = detached.progress_line(run_dir) or "no step yet"
    where = f" {where}" if where else ""
    print(f"run {run_dir} in progress{where}: {line}; report.html is written when it ends (vpscluster report "
          f"{run_dir} again then)")
    return 0


def _stderr_only(stream: str, line: str) -> None:
    import sys

    if stream == "stderr":
        print(line, file=sys.stderr)
