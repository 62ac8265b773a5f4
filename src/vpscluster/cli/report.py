"""`vpscluster report RUN_DIR`: write RUN_DIR/report.html, one self-contained file (opens offline)."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", metavar="RUN_DIR", help="a training run directory (holds metrics.jsonl)")


def run(args: argparse.Namespace) -> int:
    from vpscluster.monitor.report import write_report

    print(write_report(args.run_dir))
    return 0
