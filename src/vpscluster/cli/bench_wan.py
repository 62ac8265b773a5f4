"""`vpscluster bench wan`: plain torchrun+DDP against vpscluster's strategies on a shaped sandbox.

    vpscluster bench wan [--nodes 4] [--bandwidth 100mbit] [--cpu 0.45] [--preset small]
                         [--budget-s S] [--strategies baseline,ideal,ddp,...,auto] [--quick | --long]
                         [--targets REF@FRACTION,...] [--row NAME='TRAIN FLAGS' ...] [--out DIR] [--json]

The benchmark itself is `vpscluster.bench.wan.run_wan`; this module parses and renders.
"""

from __future__ import annotations

import argparse

from vpscluster.cli.bench import rich_table, settings_from
from vpscluster.cli.output import add_json_flag


def add_arguments(p: argparse.ArgumentParser) -> None:
    from vpscluster.bench.wan import (DEFAULT_TARGETS, LONG, LONG_BUDGET_S, LONG_DDP_EVAL_EVERY, QUICK, SHORT_BUDGET_S,
                                      SHORT_DDP_EVAL_EVERY, STRATEGIES, WanSettings)
    from vpscluster.train.presets import preset_lrs_text

    d = WanSettings()
    preset_lrs = preset_lrs_text()
    p.add_argument("--nodes", type=int, default=d.nodes, help=f"sandbox nodes (default {d.nodes})")
    p.add_argument("--bandwidth", default=d.bandwidth, help=f"link rate of every node, tc spelling (default {d.bandwidth})")
    p.add_argument("--cpu", default=d.cpu, help=f"CPU share of one core per node (default {d.cpu})")
    p.add_argument("--preset", default=d.preset, help=f"model preset (default {d.preset})")
    p.add_argument("--budget-s", type=float, default=d.budget_s,
                   help=f"training seconds per strategy (default {SHORT_BUDGET_S:g}; {LONG_BUDGET_S:g} with --long)")
    p.add_argument("--strategies", default=d.strategies,
                   help=f"comma list of: {', '.join(STRATEGIES)} (default all; with --long {','.join(LONG)}). "
                        "ideal: synchronous ddp with the links unthrottled; auto: --strategy auto, no tuning flag")
    p.add_argument("--sync-every", type=int, default=d.sync_every, help=f"DiLoCo H (default {d.sync_every})")
    p.add_argument("--ddp-eval-every", type=int, default=d.ddp_eval_every,
                   help=f"evaluate every N steps for baseline, ddp and ideal (default {SHORT_DDP_EVAL_EVERY}; "
                        f"{LONG_DDP_EVAL_EVERY} with --long)")
    p.add_argument("--diloco-eval-every", type=int, default=d.diloco_eval_every,
                   help="evaluate every N steps for diloco and auto, where the next outer update lands (default H/5)")
    p.add_argument("--eval-batches", type=int, default=d.eval_batches, help=f"validation batches per evaluation (default {d.eval_batches})")
    p.add_argument("--warmup-steps", type=int, default=d.warmup_steps,
                   help="LR warm-up steps for every run, the baseline included (default: the trainer's, 20)")
    p.add_argument("--lr", type=float, default=d.lr, help=f"peak learning rate of every run (default: the trainer's for the preset, {preset_lrs})")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help=f"only {', '.join(QUICK)} with a 60 s budget and H=25")
    mode.add_argument("--long", action="store_true",
                      help=f"the yardstick run: {', '.join(LONG)}, {LONG_BUDGET_S:g} s each, and a time-to-target table")
    p.add_argument("--targets", default=d.targets, metavar="REF@FRACTION,...",
                   help=f"target losses: a row's val loss after a fraction of its training time (default with --long: "
                        f"{DEFAULT_TARGETS}); given, the time-to-target table is made in any mode")
    p.add_argument("--row", dest="rows", action="append", default=[], metavar="NAME='TRAIN FLAGS'",
                   help="an extra row: `vpscluster train` with these flags on the shaped links, beside the others "
                        "(repeatable), e.g. --row 'auto-lr1=--strategy auto --inner-lr-scale 1'")
    p.add_argument("--name", default=d.name, help=f"sandbox name (default {d.name})")
    p.add_argument("--out", metavar="DIR", help="results folder (default bench/results/wan-<UTC time> in the current folder)")
    add_json_flag(p)


def run(args: argparse.Namespace) -> int:
    from rich.text import Text

    from vpscluster.bench.wan import WanSettings, run_wan
    from vpscluster.cli.output import console, emit_json

    con = console(args.json)
    settings = settings_from(args, WanSettings)
    doc = run_wan(settings, say=lambda line: con.print(Text(line), soft_wrap=True))
    failed = [r["strategy"] for r in doc["rows"] if r.get("failed")]
    if failed:
        con.print(f"[red]failed[/]: {', '.join(failed)} (see their logs in {doc['results_dir']})")
    if args.json:
        emit_json(doc)
    else:
        print_table(con, doc["rows"])
        if doc["targets"]:
            print_target_table(con, doc["targets"], doc["time_to_target"])
        con.print(f"results: {doc['results_dir']}")
    return 1 if failed else 0


def print_table(con, rows) -> None:
    from vpscluster.bench.wan import COLUMNS, cell

    con.print(rich_table("bench wan: same wall-clock budget per strategy", rows, COLUMNS, cell, left=("strategy",)))


def print_target_table(con, levels, rows) -> None:
    from rich.text import Text

    from vpscluster.bench.wan import FIGURE_COLUMNS, cell, target_columns, target_legend

    for title, columns in (("bench wan: figures against the ideal row", FIGURE_COLUMNS),
                           ("bench wan: time to target, s (÷ base / × ideal)", target_columns(levels))):
        con.print(rich_table(title, rows, columns, cell, left=("strategy", "ran as")))
    con.print(Text(target_legend(levels)), soft_wrap=True)
