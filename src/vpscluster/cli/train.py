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
import functools
from typing import Any

from vpscluster.cli import detach
from vpscluster.cli.flags import given, nest
from vpscluster.cli.output import add_json_flag

@functools.cache
def flag_keys() -> dict[str, str]:
    """flag dest -> dotted TrainConfig key, read from the fields' flag metadata (`config.Flag`)."""
    from vpscluster.config import flag_fields
    from vpscluster.train.config import TrainConfig

    return {ff.flag.dest: ff.key for ff in flag_fields(TrainConfig, "train")}


@functools.cache
def resume_flags() -> tuple[str, ...]:
    """The dests of the flags `--resume` accepts (`resume=True` in their metadata)."""
    from vpscluster.cli.flags import resume_dests
    from vpscluster.train.config import TrainConfig

    return resume_dests(TrainConfig, "train")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    # light: no torch, no pydantic. The config flags, their defaults, keys and choices are read
    # from the typed config's field metadata and the strategy registry: never a copy of them.
    from vpscluster.cli.flags import add_flags
    from vpscluster.train.config import TrainConfig, config_keys

    parser.epilog = f"--config FILE.yaml takes these keys: {config_keys()}. Precedence: defaults < --config < flags."
    where = parser.add_argument_group("where to train")
    groups = {"where": where, "where_one": where.add_mutually_exclusive_group(),
              "what": parser.add_argument_group("what to train"),
              "strategy": parser.add_argument_group("how ranks synchronise"),
              "uneven": parser.add_argument_group("uneven nodes (shares of the global batch)"),
              "run": parser.add_argument_group("run directory and configuration")}
    add_flags(TrainConfig, "train", groups)
    run = groups["run"]
    run.add_argument("--resume", metavar="RUN_DIR", help="continue the run in RUN_DIR from its newest valid checkpoint (only --max-steps, --time-budget and --cluster/--nodes/--nproc-per-node may change; on fewer or more ranks the checkpoint is re-cut)")
    run.add_argument("--config", metavar="FILE.yaml", help="TrainConfig keys in YAML; flags override them")
    run.add_argument("--force", action="store_true", default=None, help="cluster: start even when the pre-flight checks report problems")
    run.add_argument("--accept-new-host-keys", action="store_true", default=None, help="cluster: trust SSH host keys seen for the first time")
    run.add_argument("--insecure-network", action="store_true", default=None,
                     help="cluster: launch even over public addresses without an overlay (the rendezvous store and gloo are unauthenticated)")
    run.add_argument("--dry-run", action="store_true", help="print each node's exact command and environment; run and create nothing")
    detach.add_arguments(run, "run")
    add_json_flag(parser)


def _given(args: argparse.Namespace) -> dict[str, Any]:
    return given(args, flag_keys())


def _nest(flat: dict[str, Any]) -> dict[str, Any]:
    return nest(flat, flag_keys())


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

    keys = {flag_keys()[d].split(".", 1)[1] for d in _given(args) if flag_keys()[d].startswith("strategy.")}
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

    extra = sorted(d for d in _given(args) if d not in resume_flags()) + (["config"] if args.config else [])
    if extra:
        flags = ", ".join("--" + d.replace("_", "-") for d in extra)
        raise UserError(f"--resume keeps the run's configuration; drop {flags} (only --max-steps, --time-budget, "
                        "--cluster/--nodes/--nproc-per-node and --max-restarts/--min-nodes may change)")
    cfg = read_config(args.resume)
    given = {d: v for d, v in _given(args).items() if d in resume_flags()}
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
