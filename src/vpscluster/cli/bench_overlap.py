"""`vpscluster bench overlap`: how long an overlapped DiLoCo sync may be before compute waits.

    vpscluster bench overlap [--rows int8@100mbit,int8@80mbit,...] [--sync-every H]
                             [--overlap-steps TAU] [--budget-s S] [--out DIR] [--json]
                             [--update-benchmarks [--benchmarks FILE]]

The benchmark itself is `vpscluster.bench.overlap.run_overlap`; this module parses and renders.
"""

from __future__ import annotations

import argparse

from vpscluster.cli.bench import rich_table, settings_arguments, settings_from
from vpscluster.cli.output import add_json_flag


def add_arguments(p: argparse.ArgumentParser) -> None:
    from vpscluster.bench.overlap import OverlapSettings

    helps = {
        "rows": "WIRE@RATE per row: the pseudo-gradients' wire format and every node's link rate",
        "nodes": "sandbox nodes", "cpu": "CPU share of one core per node", "preset": "model preset",
        "sync_every": "DiLoCo H", "overlap_steps": "τ: inner steps an outer sync runs behind",
        "budget_s": "training seconds per row", "name": "sandbox name",
        "out": "results folder (default bench/results/overlap-<UTC time>)",
    }
    settings_arguments(p, OverlapSettings, helps)
    p.add_argument("--update-benchmarks", action="store_true",
                   help="write this run's tables between the overlap markers of --benchmarks (the page's prose stays)")
    p.add_argument("--benchmarks", metavar="FILE", default="BENCHMARKS.md",
                   help="the page --update-benchmarks writes (default BENCHMARKS.md in the current folder)")
    add_json_flag(p)


def run(args: argparse.Namespace) -> int:
    import shlex
    import sys

    from rich.text import Text

    from vpscluster.bench import page
    from vpscluster.bench.overlap import COLUMNS, OverlapSettings, benchmarks_block, cell, run_overlap
    from vpscluster.cli.output import console, emit_json

    con = console(args.json)
    if args.update_benchmarks:
        page.check(args.benchmarks, "overlap")  # before the sandbox, not after half an hour
    doc = run_overlap(settings_from(args, OverlapSettings), say=lambda line: con.print(Text(line), soft_wrap=True))
    if args.json:
        emit_json(doc)
    else:
        con.print(rich_table(f"bench overlap: the sync rule counts a sync hidden up to {doc['headroom']:.0%} of τ steps",
                             doc["rows"], COLUMNS, cell, left=("row",)))
        con.print(f"results: {doc['results_dir']}")
    if args.update_benchmarks:
        page.write_rows(args.benchmarks, "overlap", benchmarks_block(doc, "vpscluster " + shlex.join(sys.argv[1:])))
        if not args.json:
            con.print(f"{args.benchmarks}: the overlap tables are this run's now; its prose and bench/history/overlap.md are by hand")
    return 1 if any(r.get("failed") for r in doc["rows"]) else 0
