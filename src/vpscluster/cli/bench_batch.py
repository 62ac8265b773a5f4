"""`vpscluster bench batch`: static split, plain Dask and vpscluster batch on uneven, changing nodes.

    vpscluster bench batch [--cpu 0.45,0.45,0.45,0.15] [--rows N] [--work ROUNDS]
                           [--hog-after-s S] [--modes static,dask,vpscluster] [--out DIR] [--json]

The benchmark itself is `vpscluster.bench.batch.run_batch_bench`; this module parses and renders.
"""

from __future__ import annotations

import argparse

from vpscluster.cli.bench import settings_from
from vpscluster.cli.output import add_json_flag


def add_arguments(p: argparse.ArgumentParser) -> None:
    from vpscluster.bench.batch import MODES, BatchBenchSettings

    d = BatchBenchSettings()
    p.add_argument("--name", default=d.name, help=f"sandbox name (default {d.name})")
    p.add_argument("--cpu", default=d.cpu, help=f"CPU share of one core per node (default {d.cpu})")
    p.add_argument("--rows", type=int, default=d.rows, help=f"input rows (default {d.rows})")
    p.add_argument("--work", type=int, default=d.work, help=f"sha256 rounds per row (default {d.work})")
    p.add_argument("--partition-rows", type=int, default=d.partition_rows,
                   help=f"rows per partition for dask and vpscluster (default {d.partition_rows})")
    p.add_argument("--hog-after-s", type=float, default=d.hog_after_s,
                   help=f"a CPU hog starts in the first node this long into each run (default {d.hog_after_s:g})")
    p.add_argument("--hogs", type=int, default=d.hogs, help=f"busy processes of the hog (default {d.hogs})")
    p.add_argument("--max-load", type=float, default=d.max_load, help=f"vpscluster's admission threshold (default {d.max_load})")
    p.add_argument("--modes", default=d.modes, help=f"comma list of: {', '.join(MODES)}")
    p.add_argument("--out", metavar="DIR", help="results folder (default bench/results/batch-<UTC time>)")
    add_json_flag(p)


def run(args: argparse.Namespace) -> int:
    from rich.table import Table
    from rich.text import Text

    from vpscluster.bench.batch import COLUMNS, BatchBenchSettings, cell, run_batch_bench
    from vpscluster.cli.output import console, emit_json

    con = console(args.json)
    settings = settings_from(args, BatchBenchSettings)
    doc = run_batch_bench(settings, say=lambda line: con.print(Text(line), soft_wrap=True))
    if args.json:
        emit_json(doc)
    else:
        t = Table(title=f"bench batch: ideal makespan {doc['ideal_makespan_s']:.1f} s")
        for _, header, _ in COLUMNS:
            t.add_column(header)
        for r in doc["rows"]:
            t.add_row(*(cell(r, k, f) for k, _, f in COLUMNS))
        con.print(t)
        con.print(f"results: {doc['results_dir']}")
    return 0 if all(r["ok"] for r in doc["rows"]) else 1
