"""`vpscluster bench exporters`: tokens/s with and without the Prometheus exporters, side by side.

    vpscluster bench exporters [--pairs 2] [--budget-s 120] [--out DIR] [--json]

The benchmark itself is `vpscluster.bench.exporters.run_exporters`; this module parses and renders.
"""

from __future__ import annotations

import argparse

from vpscluster.cli.bench import rich_table, settings_arguments, settings_from
from vpscluster.cli.output import add_json_flag


def add_arguments(p: argparse.ArgumentParser) -> None:
    from vpscluster.bench.exporters import ExporterSettings

    helps = {
        "nodes": "sandbox nodes", "bandwidth": "link rate of every node", "cpu": "CPU share of every node",
        "preset": "model preset", "sync_every": "DiLoCo H", "budget_s": "training seconds per run",
        "pairs": "ABBA blocks (each: with, without, without, with)", "scrape_interval_s": "Prometheus scrape interval",
        "name": "sandbox name", "out": "results folder (default bench/results/exporters-<UTC time>)",
    }
    settings_arguments(p, ExporterSettings, helps)
    add_json_flag(p)


def run(args: argparse.Namespace) -> int:
    from rich.text import Text

    from vpscluster.bench.exporters import COLUMNS, ExporterSettings, run_exporters
    from vpscluster.bench.table import cell
    from vpscluster.cli.output import console, emit_json

    con = console(args.json)
    settings = settings_from(args, ExporterSettings)
    doc = run_exporters(settings, say=lambda line: con.print(Text(line), soft_wrap=True))
    if args.json:
        emit_json(doc)
    else:
        con.print(rich_table("bench exporters: the same run with and without exporters", doc["rows"], COLUMNS,
                             lambda r, k, f: cell(r, k, f, name_key="run"), left=("run", "exporters")))
        sm = doc["summary"]
        if "cost_pct" in sm:
            con.print(f"exporters cost {sm['cost_pct']:+.2f}% of tokens/s (spread {sm['spread_on_pct']:.1f}% with, "
                      f"{sm['spread_off_pct']:.1f}% without)")
        con.print(f"results: {doc['results_dir']}")
    return 1 if any(r.get("failed") for r in doc["rows"]) else 0
