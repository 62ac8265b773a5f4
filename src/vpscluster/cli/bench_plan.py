"""`vpscluster bench plan`: plan's predictions against measured step and communication time.

The benchmark itself is `vpscluster.bench.plan.run_plan_bench`; this module parses and renders.
"""

from __future__ import annotations

import argparse

from vpscluster.cli.output import add_json_flag


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from vpscluster.bench.plan import PlanBenchSettings

    d = PlanBenchSettings()
    parser.add_argument("--quick", action="store_true", help="one small scenario (a smoke test), not written to BENCHMARKS.md")
    parser.add_argument("--steps", type=int, default=d.steps, help=f"training steps per ddp run (default {d.steps}; diloco runs 3 rounds)")
    parser.add_argument("--sync-every", type=int, default=d.sync_every, help=f"diloco H in the short runs (default {d.sync_every})")
    parser.add_argument("--no-write", action="store_true", help="do not update BENCHMARKS.md")
    parser.add_argument("--benchmarks", metavar="FILE", default=d.benchmarks,
                        help=f"the file whose plan section is replaced (default {d.benchmarks} in the current folder)")
    parser.add_argument("--results-dir", metavar="DIR", default=d.results_dir,
                        help=f"where each run's files and results.json go (default {d.results_dir})")
    parser.add_argument("--name", default=d.name, help=f"the sandbox's name (default {d.name}; make it unique on a shared machine)")
    add_json_flag(parser)


def run(args: argparse.Namespace) -> int:
    from rich.text import Text

    from vpscluster.bench.plan import PlanBenchSettings, markdown, run_plan_bench
    from vpscluster.cli.output import console, emit_json

    out = console(args.json)
    settings = PlanBenchSettings(quick=args.quick, steps=args.steps, sync_every=args.sync_every,
                                 write=not args.no_write, benchmarks=args.benchmarks, results_dir=args.results_dir,
                                 name=args.name)
    doc = run_plan_bench(settings, say=lambda line: out.print(Text(line), soft_wrap=True))
    if args.json:
        emit_json(doc)
    else:
        out.print(markdown(doc))
    return 0
