"""`vpscluster run --cluster FILE | --nodes N [...] -- python script.py ARGS`: a torchrun script on every node.

The strategy flags (`--strategy`, `--sync-every`, `--wire-dtype`, ...) are `train`'s own: built from
the same StrategyConfig fields' flag metadata (`config.Flag`, `cli/flags.py`), with their keys,
choices and defaults, resolved into the session settings a script's `session.start()` reads
(`launch/run.py`).
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

from vpscluster.cli import detach
from vpscluster.cli.output import add_json_flag


def add_arguments(p: argparse.ArgumentParser) -> None:
    from vpscluster.cli.flags import add_flags
    from vpscluster.session.config import SessionConfig
    from vpscluster.train.config import RecoveryConfig

    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--cluster", metavar="FILE", help="the cluster file (cluster.yaml)")
    where.add_argument("--nodes", type=int, metavar="N", help="N local processes on this machine instead of a cluster")
    p.add_argument("--nproc-per-node", type=int, default=0, metavar="N",
                   help="processes per node (default: one per GPU, or one)")
    p.add_argument("--sync", metavar="DIR", help="folder sent to every node and run from (default: the current one); "
                   "likely secrets in it (id_*, *.pem, *.key, .env, .ssh/ ...) are never sent")
    p.add_argument("--run-dir", metavar="DIR", help="where logs go on this machine (default: runs/run-<time>)")
    p.add_argument("--dry-run", action="store_true", help="print each node's exact command and environment; run nothing")
    p.add_argument("--force", action="store_true", help="start even when the probe finds blocking problems")
    p.add_argument("--accept-new-host-keys", action="store_true",
                   help="trust unknown SSH host keys on first use (recorded in known_hosts)")
    p.add_argument("--insecure-network", action="store_true",
                   help="launch even over public addresses without an overlay (the rendezvous store and gloo are unauthenticated)")
    p.add_argument("--rdzv-id", metavar="ID", help="rendezvous id (default: a fresh one per launch)")
    p.add_argument("--rdzv-port", type=int, metavar="PORT", help="rendezvous port on the head (default: a free one)")
    p.add_argument("--join-timeout", type=float, default=600.0, metavar="SECONDS",
                   help="every node must join the rendezvous within this (default 600)")
    add_flags(RecoveryConfig, "run", {"where": p})
    g = p.add_argument_group("for scripts that use the session API (vpscluster.session)")
    add_flags(SessionConfig, "run", dict.fromkeys(("strategy", "uneven", "what", "timeouts"), g))
    g.add_argument("--resume", metavar="RUN_DIR", help="run again in RUN_DIR; the script's session.resume() continues from its newest checkpoint")
    detach.add_arguments(p, "run (its launcher)")
    add_json_flag(p)
    # dest is not "command": the CLI keeps the subcommand's name there.
    p.add_argument("program", nargs=argparse.REMAINDER, metavar="-- COMMAND", help="python script.py ARGS (or any program)")


def parser() -> argparse.ArgumentParser:
    """`run`'s own parser (its options, as `vpscluster run` reads them)."""
    p = argparse.ArgumentParser(prog="vpscluster run")
    add_arguments(p)
    return p


def load(args):
    import dataclasses

    from vpscluster.cluster.inventory import load_cluster, local_cluster

    if getattr(args, "cluster", None) is None:
        return local_cluster()
    cluster = load_cluster(args.cluster)
    if getattr(args, "accept_new_host_keys", False):
        cluster = dataclasses.replace(cluster, accept_new_host_keys=True)
    return cluster


def make_say(console):
    from rich.text import Text

    return lambda line: console.print(Text(line), soft_wrap=True)


def print_dry_run(doc: dict, console) -> None:
    from rich.text import Text

    for n in doc["nodes"]:
        console.print(Text(f"# {n['name']} ({n['address']}{', head' if n['head'] else ''})", style="bold"))
        console.print(Text(n["command"]), soft_wrap=True)
    for note in doc["notes"]:
        console.print(Text(f"note: {note}", style="dim"))


def print_summary(result, console) -> None:
    from rich.table import Table
    from rich.text import Text

    t = Table(title=f"run {result.rdzv_id[:12]} — {result.wall_seconds:.1f} s")
    for col in ("node", "exit", "first error", "log"):
        t.add_column(col)
    for o in result.nodes:
        t.add_row(o.name, "-" if o.exit_status is None else str(o.exit_status), Text(o.first_error or ""), Text(o.log or ""))
    console.print(t)


@functools.cache
def session_keys() -> dict[str, str]:
    """flag dest -> dotted SessionConfig key, read from the fields' flag metadata (train's own for the strategy)."""
    from vpscluster.config import flag_fields
    from vpscluster.session.config import SessionConfig

    return {ff.flag.dest: ff.key for ff in flag_fields(SessionConfig, "run")}


def session_settings(args: argparse.Namespace):
    """The SessionConfig of the flags given (`session_keys`); defaults elsewhere."""
    from vpscluster.cli.flags import given, nest
    from vpscluster.config import build
    from vpscluster.session.config import SessionConfig

    # e.g. {"strategy": {"name": "diloco", "sync_every": 8}, "time_budget_s": 60.0}
    doc = nest(given(args, session_keys()), session_keys())
    if args.resume:
        doc["resume"] = True
    return build(SessionConfig, doc, "flags")


def recovery_settings(args: argparse.Namespace):
    """`--max-restarts` and `--min-nodes` as train's RecoveryConfig (its checks, its defaults)."""
    from vpscluster.train.config import RecoveryConfig

    return RecoveryConfig(max_restarts=args.max_restarts, min_nodes=args.min_nodes or 0)


def run(args: argparse.Namespace) -> int:
    return detach.run_as_child(args, args.resume or args.run_dir, lambda: _run(args))  # the parent always names the run dir


def _run(args: argparse.Namespace) -> int:
    from vpscluster.cli.output import console as make_console, emit_json
    from vpscluster.errors import UserError
    from vpscluster.launch.pipeline import dry_run
    from vpscluster.launch.run import launch_script, recovery_policy, script_job, with_quorum_floor

    command = list(args.program)
    if command and command[0] == "--":
        command = command[1:]
    if args.nproc_per_node < 0:
        raise UserError("--nproc-per-node must be at least 1 (or 0 for one per GPU)")
    if args.join_timeout <= 0:
        raise UserError(f"--join-timeout must be a positive number of seconds, got {args.join_timeout:g}")
    if args.rdzv_port is not None and not 1 <= args.rdzv_port <= 65535:
        raise UserError(f"--rdzv-port {args.rdzv_port} is not a port (1-65535)")
    if args.nodes is not None and not 1 <= args.nodes <= 64:
        raise UserError(f"--nodes {args.nodes}: give 1 to 64 local processes, or a cluster file")
    session = session_settings(args)
    recovery_cfg = recovery_settings(args)
    run_dir = args.resume or args.run_dir
    if args.resume and args.run_dir and os.path.abspath(args.resume) != os.path.abspath(args.run_dir):
        raise UserError("--resume RUN_DIR runs in RUN_DIR; drop --run-dir")
    if args.resume and not os.path.isdir(args.resume):
        raise UserError(f"--resume {args.resume}: no such run folder; give the folder a run was started in")
    if args.resume and not args.dry_run and not args.detached_child:  # one launcher per run
        from vpscluster.launch import detached

        detached.check_free(args.resume, controller=args.controller if args.detach else None)
    console = make_console(args.json)
    cluster = load(args)
    if args.insecure_network:
        import dataclasses

        cluster = dataclasses.replace(cluster, insecure_network=True)
    plan = recovery_policy(cluster, recovery_cfg)  # a --min-nodes above the nodes is refused before anything starts
    job = script_job(cluster, command, sync=args.sync, run_dir=run_dir,
                     nproc_per_node=args.nodes or args.nproc_per_node,
                     force=args.force, rdzv_id=args.rdzv_id, rdzv_port=args.rdzv_port,
                     join_timeout_s=args.join_timeout, say=make_say(console),
                     session=with_quorum_floor(session, cluster, recovery_cfg),  # --quorum: the lighthouse's floor
                     in_place=args.nodes is not None, rejoin_poll_s=recovery_cfg.rejoin_poll_s)
    hint = None
    if job.program.kind == "script":  # the hand-written mp.spawn + MASTER_ADDR recipe: one line on what to change
        from vpscluster.launch.script_hints import hint as script_hint

        hint = script_hint(os.path.join(os.path.abspath(args.sync or os.getcwd()), job.program.target))
        if hint:
            print(hint, file=sys.stderr, flush=True)
    if args.detach and not args.dry_run:
        from vpscluster.cluster.netsafety import require_safe_network

        require_safe_network(job.cluster)  # refused here, not in the background
        if args.controller:
            return detach.start_run_on_controller(args, parser(), job, console)
        return detach.start(args, job.run_dir, console, run_dir_given=bool(args.resume or args.run_dir),
                            program=list(args.program))
    if args.dry_run:
        doc = dry_run(job)
        doc["recovery"] = {"max_restarts": plan.max_restarts, "min_nodes": plan.min_nodes, "nodes": plan.nodes,
                           "by_default": plan.by_default}
        doc["notes"] = [*doc.get("notes", []), plan.line()]
        emit_json(doc) if args.json else print_dry_run(doc, console)
        return 0
    result, _ = launch_script(cluster, command, recovery_cfg=recovery_cfg, session=session, say=make_say(console),
                              in_place=args.nodes is not None, sync=args.sync, run_dir=str(job.run_dir),
                              nproc_per_node=args.nodes or args.nproc_per_node, force=args.force,
                              rdzv_id=args.rdzv_id, rdzv_port=args.rdzv_port, join_timeout_s=args.join_timeout)
    if args.json:
        emit_json(result.to_dict())
    else:
        print_summary(result, console)
    if result.error:
        cause = f" (likely cause: the script's own rendezvous: {hint.removeprefix('hint: ')})" if hint else ""
        print(f"vpscluster run: error: {result.error}{cause}", file=sys.stderr)
    return result.exit_status
