"""`vpscluster bench SCENARIO ...`: benchmark scenarios by name (see BENCHMARKS.md).

Each scenario is a module under `vpscluster.bench` with `add_arguments(parser)` and
`run(args) -> int`, imported only when chosen.
"""

from __future__ import annotations

import argparse

SCENARIOS: dict[str, tuple[str, str]] = {
    "wan": ("vpscluster.bench.wan", "baseline DDP vs vpscluster strategies on a shaped sandbox, same wall-clock budget"),
    "plan": ("vpscluster.bench.plan", "plan's predictions against measured step and communication time"),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from vpscluster.cli import add_subcommands

    add_subcommands(parser, SCENARIOS, dest="scenario", metavar="SCENARIO", attr="_scenario")


def run(args: argparse.Namespace) -> int:
    return int(args._scenario.run(args) or 0)
