"""`vpscluster bench uneven`: balanced shares vs an even split on uneven sandbox CPUs.

    vpscluster bench uneven [--cpu 0.6,0.3,0.15] [--preset tiny] [--budget-s S]
                            [--strategies ddp,diloco] [--change-steps 30,70] [--out DIR] [--json]

The benchmark itself is `vpscluster.bench.uneven.run_uneven`; this module parses and renders.
"""

from __future__ import annotations

import argparse

from vpscluster.cli.bench import rich_table, settings_arguments, settings_from
from vpscluster.cli.output import add_json_flag


def add_arguments(p: argparse.ArgumentParser) -> None:
    from vpscluster.bench.uneven import UnevenSettings

    helps = {
        "cpu": "uneven CPU share per node (the even run spreads their sum evenly)",
        "bandwidth": "link rate of every node (fast: compute is the limit)",
        "preset": "model preset", "batch_size": "sequences per micro-batch", "micro_batches": "micro-batches per step in all",
        "budget_s": "training seconds per run", "strategies": "comma list of ddp, diloco", "sync_every": "DiLoCo H",
        "rebalance_every": "steps between speed measurements", "eval_every": "validation every N steps",
        "change_steps": "DROP,BACK: node 1 drops to a third of its CPU at step DROP, back at BACK",
        "change_max_steps": "steps of the change run", "name": "sandbox name",
        "out": "results folder (default bench/results/uneven-<UTC time>)",
    }
    settings_arguments(p, UnevenSettings, helps)
    add_json_flag(p)


def run(args: argparse.Namespace) -> int:
    from rich.text import Text

    from vpscluster.bench.uneven import COLUMNS, UnevenSettings, cell, run_uneven
    from vpscluster.cli.output import console, emit_json

    con = console(args.json)
    settings = settings_from(args, UnevenSettings)
    doc = run_uneven(settings, say=lambda line: con.print(Text(line), soft_wrap=True))
    failed = [r["run"] for r in doc["rows"] if r.get("failed")]
    if args.json:
        emit_json(doc)
    else:
        con.print(rich_table("bench uneven: same wall-clock budget per run", doc["rows"], COLUMNS, cell, left=("run",)))
        con.print(f"results: {doc['results_dir']}")
    return 1 if failed else 0
