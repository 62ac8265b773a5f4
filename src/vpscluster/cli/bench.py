"""`vpscluster bench SCENARIO ...`: benchmark scenarios by name (see BENCHMARKS.md).

Each scenario is a module under `vpscluster.bench` with `add_arguments(parser)` and
`run(args) -> int`, imported only when chosen.
"""

from __future__ import annotations

import argparse
import importlib

SCENARIOS: dict[str, tuple[str, str]] = {
    "wan": ("vpscluster.bench.wan", "baseline DDP vs vpscluster strategies on a shaped sandbox, same wall-clock budget"),
    "plan": ("vpscluster.bench.plan", "plan's predictions against measured step and communication time"),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="scenario", metavar="SCENARIO")
    sub.required = True
    for name, (module_name, help_text) in SCENARIOS.items():
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            if e.name == module_name:
                continue
            raise
        p = sub.add_parser(name, help=help_text, description=help_text)
        module.add_arguments(p)
        p.set_defaults(_scenario=module)


def run(args: argparse.Namespace) -> int:
    return int(args._scenario.run(args) or 0)
