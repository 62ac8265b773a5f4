"""`vpscluster bench faults`: a scripted schedule of faults during a DiLoCo and a DDP run, against
fault-free runs of the same length.

    vpscluster bench faults [--strategies diloco,ddp] [--faults worker-kill,link-5s,...] [--out DIR] [--json]

The benchmark itself is `vpscluster.bench.faults.run_faults`; this module parses and renders.
"""

from __future__ import annotations

import argparse

from vpscluster.cli.bench import rich_table, settings_arguments, settings_from
from vpscluster.cli.output import add_json_flag


def add_arguments(p: argparse.ArgumentParser) -> None:
    from vpscluster.bench.faults import FaultSettings

    helps = {
        "strategies": "comma list of diloco, ddp", "faults": "the schedule, in order (also: head-down; node-dead, last)",
        "bandwidth": "link rate of every node", "preset": "model preset",
        "gap_steps": "steps of undisturbed training between two faults",
        "checkpoint_every": "steps between checkpoints (DiLoCo: also its H)",
        "timeout_s": "sync time-out (DiLoCo; the training collectives get twice this)",
        "stop_s": "seconds node-3 stays SIGSTOPped", "link_long_s": "seconds of the long link outage", "head_down_s": "seconds the head (node-1) is cut off (fault head-down)",
        "disk_full_s": "seconds node-2's disk stays full", "throttle_s": "seconds node-3's link runs at 1 Mbit/s",
        "hang_s": "no step this long after a fault ended counts as a hang", "name": "sandbox name",
        "out": "results folder (default bench/results/faults-<UTC time>)",
    }
    settings_arguments(p, FaultSettings, helps)
    add_json_flag(p)


def run(args: argparse.Namespace) -> int:
    from rich.text import Text

    from vpscluster.bench.faults import FAULT_COLUMNS, RUN_COLUMNS, FaultSettings, cell, run_faults
    from vpscluster.cli.output import console, emit_json

    con = console(args.json)
    settings = settings_from(args, FaultSettings)
    doc = run_faults(settings, say=lambda line: con.print(Text(line), soft_wrap=True))
    bad = [r["run"] for r in doc["rows"] if r.get("failed") or r.get("hang") or r.get("hangs")]
    if args.json:
        emit_json(doc)
    else:
        for title, columns, rows in (("bench faults: each fault", FAULT_COLUMNS, [r for r in doc["rows"] if "fault" in r]),
                                     ("bench faults: each run against its fault-free twin", RUN_COLUMNS,
                                      [r for r in doc["rows"] if "fault" not in r])):
            con.print(rich_table(title, rows, columns, cell, left=("run", "fault", "node")))
        con.print(f"results: {doc['results_dir']}")
    return 1 if bad else 0
