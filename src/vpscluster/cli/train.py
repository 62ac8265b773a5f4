"""`vpscluster train`: train the built-in GPT on the local cluster or on a cluster file.

Configuration has one source of truth, built in this order: TrainConfig defaults <
`--config FILE.yaml` < the flags the user actually gave (every flag defaults to None, meaning
"not given"). `--resume RUN_DIR` reloads RUN_DIR/config.yaml and accepts only --max-steps,
--time-budget and where to run (--cluster, --nodes, --nproc-per-node: a run goes on without a
dead node, its checkpoint re-cut for the ranks present) on top. The resolved configuration is
written to the run directory, which the workers read.
"""

from __future__ import annotations

import argparse
from typing import Any

from vpscluster.cli import detach
from vpscluster.cli.output import add_json_flag

# flag dest -> dotted TrainConfig key
FLAG_KEYS: dict[str, str] = {
    "cluster": "cluster",
    "nodes": "nodes",
    "preset": "preset",
    "strategy": "strategy.name",
    "max_steps": "max_steps",
    "time_budget": "time_budget_s",
    "run_dir": "run_dir",
    "data": "data",
    "batch_size": "batch_size",
    "lr": "lr",
    "seed": "seed",
    "eval_every": "eval_every",
    "checkpoint_every": "checkpoint_every",
    "nproc_per_node": "nproc_per_node",
    "threads_per_rank": "threads_per_rank",
    "exporters": "exporters",
    "compress": "strategy.compress",
    "powersgd_rank": "strategy.powersgd_rank",
    "sync_every": "strategy.sync_every",
    "outer_lr": "strategy.outer_lr",
    "outer_momentum": "strategy.outer_momentum",
    "outer_warmup": "strategy.outer_warmup",
    "inner_lr_scale": "strategy.inner_lr_scale",
    "wire_dtype": "strategy.wire_dtype",
    "fragments": "strategy.fragments",
    "overlap_steps": "strategy.overlap_steps",
    "micro_batches": "strategy.micro_batches",
    "balance": "strategy.balance",
    "speeds": "strategy.speeds",
    "min_share": "strategy.min_share",
    "max_spread": "strategy.max_spread",
    "rebalance_every": "strategy.rebalance_every",
    "quorum": "strategy.quorum",
    "max_restarts": "recovery.max_restarts",
    "min_nodes": "recovery.min_nodes",
}
RESUME_FLAGS = ("max_steps", "time_budget", "cluster", "nodes", "nproc_per_node", "max_restarts", "min_nodes")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    # light: no torch, no pydantic. Defaults, keys and choices are read from the typed config and
    # the strategy registry: help shows the real ones, never a copy of them.
    from vpscluster.train.config import TrainConfig, config_keys, strategy_choices
    from vpscluster.launch.recovery import default_restarts
    from vpscluster.train.presets import preset_lrs_text

    d = TrainConfig()
    s = d.strategy
    preset_lrs = preset_lrs_text()
    parser.epilog = f"--config FILE.yaml takes these keys: {config_keys()}. Precedence: defaults < --config < flags."
    where = parser.add_argument_group("where to train")
    g = where.add_mutually_exclusive_group()
    g.add_argument("--cluster", metavar="FILE", help="cluster.yaml: train across its nodes over SSH (default: this machine)")
    g.add_argument("--nodes", type=int, metavar="N", help=f"number of local worker processes when there is no cluster file (default {d.nodes})")
    where.add_argument("--nproc-per-node", type=int, metavar="N", help="ranks per cluster node (default: one per GPU, else one)")
    where.add_argument("--max-restarts", type=int, metavar="N",
                       help=f"after a failure, relaunch from the last checkpoint on the nodes that answer, up to N times "
                            f"(default on a cluster of two or more nodes: twice the node count, at least {default_restarts(1)}; "
                            "on this machine's local cluster: 0. 0 turns recovery off: the first failure ends the run)")
    where.add_argument("--min-nodes", type=int, metavar="N",
                       help="go on with at least N nodes when some stop answering; a node that answers again takes part "
                            "again (default: half the nodes, rounded up; each node holds a whole replica, so fewer "
                            "nodes need no more memory per node)")
    where.add_argument("--threads-per-rank", type=int, metavar="N", help="torch threads per rank (default: the CPUs the node really grants, cgroup quota included, divided among its ranks)")

    what = parser.add_argument_group("what to train")
    what.add_argument("--preset", metavar="NAME", help=f"model shape: tiny (~1M), small (~10M); bigger ones are for `plan` (default {d.preset})")
    what.add_argument("--data", metavar="PATH", help="a text file or a folder of text files (default: the bundled King James Bible)")
    what.add_argument("--max-steps", type=int, metavar="N", help=f"optimizer steps to train (default {d.max_steps})")
    what.add_argument("--time-budget", type=float, metavar="SECONDS", help="stop cleanly, with a checkpoint, after this much training time (per session)")
    what.add_argument("--batch-size", type=int, metavar="N", help="sequences per rank per step (default: the preset's)")
    what.add_argument("--lr", type=float, help=f"peak learning rate (default: the preset's, {preset_lrs}; {d.warmup_steps} warm-up steps, then cosine decay)")
    what.add_argument("--seed", type=int, help=f"seed for weights and data order (default {d.seed})")
    what.add_argument("--eval-every", type=int, metavar="N", help=f"validation loss every N steps (default {d.eval_every})")
    what.add_argument("--checkpoint-every", type=int, metavar="N", help=f"checkpoint every N steps (default {d.checkpoint_every}; always one at the end)")

    strat = parser.add_argument_group("how ranks synchronise")
    strat.add_argument("--strategy", choices=strategy_choices("name"), help=f"ddp: all-reduce every step; diloco: sync every H steps; auto: let the planner choose (default {s.name})")
    strat.add_argument("--compress", choices=strategy_choices("compress"), help=f"ddp gradient compression on the wire (default {s.compress})")
    strat.add_argument("--powersgd-rank", type=int, metavar="R", help=f"rank of PowerSGD's low-rank factors (default {s.powersgd_rank})")
    strat.add_argument("--sync-every", type=int, metavar="H", help="diloco: inner steps between outer syncs (default: from the plan, see train/strategies/sync_rule.py)")
    strat.add_argument("--outer-lr", type=float, help=f"diloco: outer Nesterov learning rate (default {s.outer_lr}, the plan's)")
    strat.add_argument("--outer-momentum", type=float, help=f"diloco: outer Nesterov momentum (default {s.outer_momentum}, the plan's)")
    strat.add_argument("--outer-warmup", type=int, metavar="SYNCS", help="diloco: outer syncs from plain averaging to the outer optimizer (default: about 100 steps' worth; 0 = none)")
    strat.add_argument("--inner-lr-scale", type=float, metavar="X", help="diloco: each replica's AdamW runs at lr times X (default: 1/sqrt(replicas), as each steps on 1/M of the global batch that --lr is set for)")
    strat.add_argument("--wire-dtype", choices=strategy_choices("wire_dtype"), help="diloco: dtype of the pseudo-gradient on the wire (default: from the plan, fp32 on fast links, int8 on slow)")
    strat.add_argument("--fragments", type=int, metavar="N", help=f"streaming diloco: fragments synced at staggered steps (default {s.fragments})")
    strat.add_argument("--quorum", action=argparse.BooleanOptionalAction, default=None,
                       help="diloco on torchft's per-step quorum: a lighthouse on the head, one replica group per "
                            "node with its own rendezvous; a node that dies is left out at the next sync and the "
                            "others train on without a relaunch (needs torchft 0.2.0 on the nodes; default off)")
    strat.add_argument("--overlap-steps", type=int, metavar="TAU", help=f"diloco: inner steps computed while an outer sync is on the wire; its update lands TAU steps late (default {s.overlap_steps}, capped at H-1; 0 = blocking)")

    uneven = parser.add_argument_group("uneven nodes (shares of the global batch)")
    uneven.add_argument("--micro-batches", type=int, metavar="N", help="micro-batches of --batch-size sequences per step in all, split among the ranks by speed (default: one per rank)")
    uneven.add_argument("--balance", action=argparse.BooleanOptionalAction, default=None,
                        help="measure each rank's speed as it trains and re-split the micro-batches when it changes "
                             "(default: on, with a split chosen from the probe, when the nodes' speeds differ by more "
                             "than 15%%; --no-balance: the even split, every rank waits for the slowest)")
    uneven.add_argument("--speeds", type=_speeds, metavar="S,S,...", help="relative speed of each rank to start from (e.g. 3,1; default with --balance: the cluster's last probe, else even)")
    uneven.add_argument("--min-share", type=int, metavar="N", help=f"micro-batches every rank keeps (default {s.min_share})")
    uneven.add_argument("--max-spread", type=float, metavar="X", help=f"treat no rank as more than X times slower than the fastest (default {s.max_spread:g}; 0 = no bound)")
    uneven.add_argument("--rebalance-every", type=int, metavar="K", help=f"steps between speed measurements (default {s.rebalance_every})")

    run = parser.add_argument_group("run directory and configuration")
    run.add_argument("--run-dir", metavar="DIR", help="where the run is written (default runs/<UTC time>-<random>)")
    run.add_argument("--resume", metavar="RUN_DIR", help="continue the run in RUN_DIR from its newest valid checkpoint (only --max-steps, --time-budget and --cluster/--nodes/--nproc-per-node may change; on fewer or more ranks the checkpoint is re-cut)")
    run.add_argument("--config", metavar="FILE.yaml", help="TrainConfig keys in YAML; flags override them")
    run.add_argument("--force", action="store_true", default=None, help="cluster: start even when the pre-flight checks report problems")
    run.add_argument("--accept-new-host-keys", action="store_true", default=None, help="cluster: trust SSH host keys seen for the first time")
    run.add_argument("--no-exporters", dest="exporters", action="store_false", default=None,
                     help="serve no Prometheus metrics from the ranks and nodes (see `vpscluster monitor`)")
    run.add_argument("--insecure-network", action="store_true", default=None,
                     help="cluster: launch even over public addresses without an overlay (the rendezvous store and gloo are unauthenticated)")
    run.add_argument("--dry-run", action="store_true", help="print each node's exact command and environment; run and create nothing")
    detach.add_arguments(run, "run")
    add_json_flag(parser)


def _speeds(text: str) -> list[float]:
    try:
        return [float(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of numbers (e.g. 3,1)") from None


def _given(args: argparse.Namespace) -> dict[str, Any]:
    return {dest: getattr(args, dest) for dest in FLAG_KEYS if getattr(args, dest, None) is not None}


def _nest(flat: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for dest, value in flat.items():
        *parents, leaf = FLAG_KEYS[dest].split(".")
        node = out
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return out


def resolve_config(args: argparse.Namespace):
    """The TrainConfig for a new run: defaults < --config YAML < given flags.

    Reads only (the config file, the data path's existence); `launch.train.prepare_training`
    loads the cluster file before anything is created.
    """
    from vpscluster.train.config import resolve

    return resolve(args.config, _nest(_given(args)))


def given_strategy_keys(args: argparse.Namespace) -> set[str]:
    """The `strategy.*` keys the user set, by flag or in --config: the planner fills in the rest."""
    from vpscluster.config import load_yaml

    keys = {FLAG_KEYS[d].split(".", 1)[1] for d in _given(args) if FLAG_KEYS[d].startswith("strategy.")}
    if args.config:
        section = load_yaml(args.config, "--config").get("strategy")
        if isinstance(section, dict):
            keys |= {str(k) for k in section}
    return keys


def resolve_resume(args: argparse.Namespace):
    from vpscluster.config import build, merge, to_dict
    from vpscluster.errors import UserError
    from vpscluster.train.config import TrainConfig
    from vpscluster.train.rundir import read_config

    extra = sorted(d for d in _given(args) if d not in RESUME_FLAGS) + (["config"] if args.config else [])
    if extra:
        flags = ", ".join("--" + d.replace("_", "-") for d in extra)
        raise UserError(f"--resume keeps the run's configuration; drop {flags} (only --max-steps, --time-budget, "
                        "--cluster/--nodes/--nproc-per-node and --max-restarts/--min-nodes may change)")
    cfg = read_config(args.resume)
    given = {d: v for d, v in _given(args).items() if d in RESUME_FLAGS}
    if "nodes" in given:
        given["cluster"] = None  # local processes now, whatever the run had
    overrides = _nest(given)
    return build(TrainConfig, merge(to_dict(cfg), overrides), "flags")



def run(args: argparse.Namespace) -> int:
    return detach.run_as_child(args, args.resume or args.run_dir, lambda: _run(args))  # the parent always names the run dir


def _run(args: argparse.Namespace) -> int:
    from vpscluster.cli.output import console, emit_json
    from vpscluster.cli.progress import ProgressView
    from vpscluster.launch import train

    out = console(args.json)
    cfg = resolve_resume(args) if args.resume is not None else resolve_config(args)
    if args.resume is not None and not args.dry_run:  # one launcher per run: refused before any planning
        from vpscluster.launch import detached

        detached.check_free(args.resume, controller=args.controller if args.detach else None)
    # Everything is checked (the cluster file loaded, the data read) before anything is created.
    prepared = train.prepare_training(cfg, resume_dir=args.resume, force=bool(args.force),
                                      accept_new_host_keys=bool(args.accept_new_host_keys),
                                      insecure_network=bool(args.insecure_network),
                                      given=None if args.resume is not None else given_strategy_keys(args))
    if prepared.strategy_reason:
        out.print(prepared.strategy_line(bold=True))
    if prepared.speeds_note and not args.dry_run:  # a dry run lists it with its notes
        out.print(prepared.speeds_note, markup=False, soft_wrap=True)
    if args.detach:
        if not args.dry_run:  # refused here, before "started": the launcher would only fail in the background
            from vpscluster.cluster.netsafety import require_safe_network

            require_safe_network(prepared.cluster)
            if not args.json and not prepared.local:  # the background launcher says it again in its log
                out.print(prepared.recovery().line(), markup=False, soft_wrap=True)
        if args.controller:
            return detach.start_on_controller(args, prepared, out)
        return detach.start(args, prepared.run_dir, out, run_dir_given=args.resume is not None or args.run_dir is not None)
    if args.dry_run:
        from vpscluster.cli.run import print_dry_run

        doc = train.dry_run_training(prepared)
        emit_json(doc) if args.json else print_dry_run(doc, out)
        return 0
    with ProgressView(json_mode=args.json, console=out) as view:
        say = _warnings_only(view.log_line) if prepared.local else view.log_line
        from vpscluster.monitor.targets import chain, run_targets

        sink = None
        if args.detached_child:  # rank 0's progress, readable while the run goes (`vpscluster report`)
            from vpscluster.launch.detached import progress_sink

            sink = progress_sink(prepared.run_dir)
        targets = run_targets(prepared.cluster, prepared.run_dir.name, say)
        report = train.launch_training(prepared, say=say, on_event=chain(sink, view.handle, targets))
    html_report = _html_report(prepared.run_dir, out)  # --json prints report.json exactly; the file is beside it
    if args.json:
        emit_json(report)
    else:
        view.summary(report)
        if html_report:
            out.print(f"charts: {html_report}")
    return 0


def _html_report(run_dir, out) -> str | None:
    """RUN_DIR/report.html; a run that trained fine is not failed by its charts."""
    from vpscluster.monitor.report import write_report

    try:
        return str(write_report(run_dir))
    except Exception as e:
        out.print(f"[yellow]warning:[/] no report.html ({type(e).__name__}: {e}); try `vpscluster report {run_dir}`")
        return None


def _warnings_only(show):
    """On the local cluster only the workers' warnings are shown (as they print them): the
    progress bar says the rest, and every line is kept in logs/."""
    import re

    prefix = re.compile(r"^[\w.-]+/\d+: ")

    def say(line: str) -> None:
        text = prefix.sub("", line, count=1)
        if text != line and text.lstrip().startswith("warning:"):
            show(text)

    return say
