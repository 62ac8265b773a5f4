"""`vpscluster bench SCENARIO ...`: benchmark scenarios by name (see BENCHMARKS.md).

Each scenario is a CLI module here (`bench_<name>.py`: `add_arguments(parser)`, `run(args) -> int`)
over a plain library function in `vpscluster.bench.<name>`.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

SCENARIOS: dict[str, tuple[str, str]] = {
    "wan": ("vpscluster.cli.bench_wan", "baseline DDP vs vpscluster strategies on a shaped sandbox, same wall-clock budget"),
    "batch": ("vpscluster.cli.bench_batch", "static split vs plain Dask vs vpscluster batch on uneven nodes with a CPU hog"),
    "plan": ("vpscluster.cli.bench_plan", "plan's predictions against measured step and communication time"),
    "uneven": ("vpscluster.cli.bench_uneven", "balanced shares vs an even split on uneven (and changing) sandbox CPUs"),
    "exporters": ("vpscluster.cli.bench_exporters", "tokens/s with and without the Prometheus exporters, side by side"),
    "faults": ("vpscluster.cli.bench_faults", "a scripted schedule of faults during a DiLoCo and a DDP run vs fault-free runs"),
    "overlap": ("vpscluster.cli.bench_overlap", "DiLoCo's overlapped sync against the step: utilisation as the link slows"),
    "vertical": ("vpscluster.cli.bench_vertical", "the vertical split (products example) at staleness K=0 vs K>=1, side by side"),
    "torchft": ("vpscluster.cli.bench_torchft", "torchft's per-step quorum on gloo/CPU: a replica killed mid-run, then back"),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from vpscluster.cli import add_subcommands

    add_subcommands(parser, SCENARIOS, dest="scenario", metavar="SCENARIO", attr="_scenario")


def run(args: argparse.Namespace) -> int:
    return int(args._scenario.run(args) or 0)


def settings_arguments(p: argparse.ArgumentParser, settings_cls: type, helps: dict[str, str]) -> None:
    """One `--flag` per field of a scenario's settings dataclass, typed and defaulted from it."""
    for f in dataclasses.fields(settings_cls):
        kind = {int: int, float: float}.get(type(f.default), str) if f.default is not None else str
        p.add_argument("--" + f.name.replace("_", "-"), type=kind, default=f.default,
                       help=f"{helps[f.name]} (default {f.default})")


def settings_from(args: argparse.Namespace, settings_cls: type) -> Any:
    """The scenario's settings dataclass, filled from the parsed flags of the same names."""
    return settings_cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(settings_cls)})


def rich_table(title: str, rows: list[dict[str, Any]], columns, cell_fn, left: tuple[str, ...] = ()) -> Any:
    """A benchmark's rows as a rich Table: `columns` are (key, header, format) triples (as for
    `bench.table.markdown`), `cell_fn(row, key, fmt)` formats one value; headers in `left` are
    left-aligned, the others (figures) right-aligned."""
    from rich.table import Table

    t = Table(title=title)
    for _, header, _ in columns:
        t.add_column(header, justify="left" if header in left else "right")
    for r in rows:
        t.add_row(*(cell_fn(r, k, f) for k, _, f in columns))
    return t
