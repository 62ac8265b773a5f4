"""`vpscluster run --cluster FILE [...] -- python script.py ARGS`: a torchrun script on every node."""

from __future__ import annotations

import argparse
import sys

from vpscluster.cli.output import add_json_flag


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cluster", required=True, metavar="FILE", help="the cluster file (cluster.yaml)")
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
    add_json_flag(p)
    # dest is not "command": the CLI keeps the subcommand's name there.
    p.add_argument("program", nargs=argparse.REMAINDER, metavar="-- COMMAND", help="python script.py ARGS (or any program)")


def load(args):
    import dataclasses

    from vpscluster.cluster.inventory import load_cluster

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


def run(args: argparse.Namespace) -> int:
    from vpscluster.cli.output import console as make_console, emit_json
    from vpscluster.errors import UserError
    from vpscluster.launch.pipeline import dry_run, launch
    from vpscluster.launch.run import script_job

    command = list(args.program)
    if command and command[0] == "--":
        command = command[1:]
    if args.nproc_per_node < 0:
        raise UserError("--nproc-per-node must be at least 1 (or 0 for one per GPU)")
    if args.join_timeout <= 0:
        raise UserError(f"--join-timeout must be a positive number of seconds, got {args.join_timeout:g}")
    if args.rdzv_port is not None and not 1 <= args.rdzv_port <= 65535:
        raise UserError(f"--rdzv-port {args.rdzv_port} is not a port (1-65535)")
    console = make_console(args.json)
    cluster = load(args)
    if args.insecure_network:
        import dataclasses

        cluster = dataclasses.replace(cluster, insecure_network=True)
    job = script_job(cluster, command, sync=args.sync, run_dir=args.run_dir, nproc_per_node=args.nproc_per_node,
                     force=args.force, rdzv_id=args.rdzv_id, rdzv_port=args.rdzv_port,
                     join_timeout_s=args.join_timeout, say=make_say(console))
    if args.dry_run:
        doc = dry_run(job)
        emit_json(doc) if args.json else print_dry_run(doc, console)
        return 0
    result = launch(job)
    if args.json:
        emit_json(result.to_dict())
    else:
        print_summary(result, console)
    if result.error:
        print(f"vpscluster run: error: {result.error}", file=sys.stderr)
    return result.exit_status
