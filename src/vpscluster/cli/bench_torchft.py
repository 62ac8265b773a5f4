"""`vpscluster bench torchft`: torchft's per-step quorum on gloo/CPU, a replica killed and brought back.

    vpscluster bench torchft [--replicas 3] [--kill-at-s 25] [--back-at-s 45] [--out DIR] [--json]

The benchmark itself is `vpscluster.bench.torchft_check.run_torchft`; this module parses and renders.
"""

from __future__ import annotations

import argparse

from vpscluster.cli.bench import settings_arguments, settings_from
from vpscluster.cli.output import add_json_flag


def add_arguments(p: argparse.ArgumentParser) -> None:
    from vpscluster.bench.torchft_check import TorchftSettings

    helps = {
        "replicas": "replica groups (local processes)", "sync_every": "DiLoCo H (torchft's DiLoCo)",
        "step_s": "seconds each inner step sleeps (stands for compute)", "steps": "outer syncs each replica runs",
        "victim": "the replica killed and started again", "kill_at_s": "SIGKILL at this second",
        "back_at_s": "started again at this second", "timeout_s": "the whole run's limit",
        "hidden": "the MLP's width (64 -> hidden -> 8)",
        "bandwidth": "run each replica on its own sandbox node with links of this rate (e.g. 100mbit; default: local processes)",
        "cpu": "the sandbox nodes' CPU share", "name": "sandbox name",
        "out": "results folder (default bench/results/torchft-<UTC time>)",
    }
    settings_arguments(p, TorchftSettings, helps)
    add_json_flag(p)


def run(args: argparse.Namespace) -> int:
    from rich.table import Table
    from rich.text import Text

    from vpscluster.bench.table import cell
    from vpscluster.bench.torchft_check import COLUMNS, TorchftSettings, run_torchft
    from vpscluster.cli.output import console, emit_json

    con = console(args.json)
    doc = run_torchft(settings_from(args, TorchftSettings), say=lambda line: con.print(Text(line), soft_wrap=True))
    sm = doc["summary"]
    if args.json:
        emit_json(doc)
    else:
        t = Table(title=f"bench torchft: torchft {doc['torchft']} on gloo/CPU, one replica killed and back")
        t.add_column("check")
        t.add_column("value", justify="right")
        for k, header, f in COLUMNS:
            t.add_row(header, cell(sm, k, f))
        con.print(t)
        con.print(f"results: {doc['results_dir']}")
    ok = sm["mismatched_syncs"] == 0 and sm["victim_equal_after_rejoin"] and all(c == 0 for c in doc["exit_codes"].values())
    return 0 if ok else 1
