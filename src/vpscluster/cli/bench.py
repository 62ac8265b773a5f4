"""`vpscluster bench SCENARIO ...`: benchmark scenarios by name (see BENCHMARKS.md).

Each scenario is a CLI module here (`bench_<name>.py`: `add_arguments(parser)`, `run(args) -> int`)
over a plain library function in `vpscluster.bench.<name>`.
"""

from __future__ import annotations

import argparse

SCENARIOS: dict[str, tuple[str, str]] = {
    "wan": ("vpscluster.cli.bench_wan", "baseline DDP vs vpscluster strategies on a shaped sandbox, same wall-clock budget"),
    "batch": ("vpscluster.cli.bench_batch", "static split vs plain Dask vs vpscluster batch on uneven nodes with a CPU hog"),
    "plan": ("vpscluster.cli.bench_plan", "plan's predictions against measured step and communication time"),
    "uneven": ("vpscluster.cli.bench_uneven", "balanced shares vs an even split on uneven (and changing) sandbox CPUs"),
    "exporters": ("vpscluster.cli.bench_exporters", "tokens/s with and without the Prometheus exporters, side by side"),
    "faults": ("vpscluster.cli.bench_faults", "a scripted schedule of faults during a DiLoCo and a DDP run vs fault-free runs"),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from vpscluster.cli import add_subcommands

    add_subcommands(parser, SCENARIOS, dest="scenario", metavar="SCENARIO", attr="_scenario")


def run(args: argparse.Namespace) -> int:
    return int(args._scenario.run(args) or 0)
