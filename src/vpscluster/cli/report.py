"""`vpscluster report RUN_DIR`: write RUN_DIR/report.html, one self-contained file (opens offline)."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", metavar="RUN_DIR", help="a training run directory (holds metrics.jsonl)")


def run(args: argparse.Namespace) -> int:
    from vpscluster.launch import controller, detached
    from vpscluster.monitor.report import write_report

    state = detached.read_state(args.run_dir)
    if controller.is_remote(state):  # written on the controller node, from its run dir; fetched here
        status = controller.remote_cli(state, ["report", state["remote_run_dir"]], timeout_s=600.0, on_line=_stderr_only)
        got = controller.fetch(args.run_dir, state)
        if status != 0 or "report.html" not in got:
            from vpscluster.errors import RemoteError

            raise RemoteError(f"the controller node {state['controller']} could not write the report (exit status "
                              f"{status}); see vpscluster logs {args.run_dir}")
        from pathlib import Path

        print(Path(args.run_dir) / "report.html")
        return 0
    print(write_report(args.run_dir))
    return 0


def _stderr_only(stream: str, line: str) -> None:
    import sys

    if stream == "stderr":
        print(line, file=sys.stderr)
