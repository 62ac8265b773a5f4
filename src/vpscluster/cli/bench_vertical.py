"""`vpscluster bench vertical`: the vertical split at staleness K = 0 against K >= 1, side by side.

The benchmark itself is `vpscluster.bench.vertical.run_vertical_bench`; this module parses and renders.
"""

from __future__ import annotations

import argparse

from vpscluster.cli.output import add_json_flag

HELPS = {"staleness": "the K of each run, comma-separated", "nodes": "sandbox nodes",
         "bandwidth": "each sandbox node's link (tc rate)", "latency_ms": "added one-way latency (ms)",
         "rows": "generated products", "epochs": "epochs per run",
         "dim": "each tower's embedding width", "image_hidden": "the image tower's hidden width",
         "image_depth": "the image tower's hidden layers", "name": "the sandbox's name",
         "out": "results folder (default bench/results/vertical-<time>)"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from vpscluster.bench.vertical import VerticalBenchSettings
    from vpscluster.cli.bench import settings_arguments

    settings_arguments(parser, _flagged(VerticalBenchSettings), HELPS)
    parser.add_argument("--local", action="store_true", help="this machine's processes, no sandbox")
    add_json_flag(parser)


def _flagged(cls):
    import dataclasses

    """The settings less `local` (a switch, not a typed flag)."""
    fields = [(f.name, f.type, dataclasses.field(default=f.default)) for f in dataclasses.fields(cls) if f.name != "local"]
    return dataclasses.make_dataclass("Flags", fields)


def run(args: argparse.Namespace) -> int:
    from rich.text import Text

    from vpscluster.bench.vertical import VerticalBenchSettings, markdown, run_vertical_bench
    from vpscluster.cli.bench import settings_from
    from vpscluster.cli.output import console, emit_json

    out = console(args.json)
    settings = VerticalBenchSettings(**vars(settings_from(args, _flagged(VerticalBenchSettings))), local=args.local)
    doc = run_vertical_bench(settings, say=lambda line: out.print(Text(line), soft_wrap=True))
    if args.json:
        emit_json(doc)
    else:
        out.print(markdown(doc))
    return 0
