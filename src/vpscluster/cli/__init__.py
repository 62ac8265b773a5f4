"""The `vpscluster` command: a thin layer that parses, calls the library and renders.

Each subcommand lives in its own module here with two functions:

    add_arguments(parser: argparse.ArgumentParser) -> None
    run(args: argparse.Namespace) -> int        # the exit status

Modules import nothing heavy at top level (torch, asyncssh, dask are imported inside `run`),
so `vpscluster --help` stays instant. A `UserError` raised anywhere below becomes one line on
stderr and a non-zero exit, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from vpscluster import __version__
from vpscluster.errors import Interrupted, UserError

# name -> (module, one-line help). Order is the order shown in --help.
COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("vpscluster.cli.train", "train the built-in GPT model on the local cluster or a cluster file"),
    "run": ("vpscluster.cli.run", "run any torchrun-compatible script on every node of a cluster"),
    "exec": ("vpscluster.cli.exec_", "run a shell command on every node in parallel"),
    "probe": ("vpscluster.cli.probe", "measure every node and every link; report problems"),
    "plan": ("vpscluster.cli.plan", "predict memory, step time, egress and time to train; pick a strategy"),
    "provision": ("vpscluster.cli.provision", "pin the environment, tune, firewall and mesh every node of a cluster (Ansible), idempotently"),
    "sandbox": ("vpscluster.cli.sandbox", "an emulated WAN cluster on this machine (root): up, down, status"),
    "batch": ("vpscluster.cli.batch", "run a Python function over partitioned data on every node (Dask)"),
    "bench": ("vpscluster.cli.bench", "run a benchmark scenario and write its table"),
    "monitor": ("vpscluster.cli.monitor", "Prometheus for a cluster: up, down, status, a Grafana dashboard"),
    "queue": ("vpscluster.cli.queue", "the message queue (NATS JetStream) on the head: up, down, status"),
    "vertical": ("vpscluster.cli.vertical", "a model split by columns: towers on their nodes, a fusion head, over the queue"),
    "top": ("vpscluster.cli.top", "a live view of every node and the current run (from Prometheus)"),
    "report": ("vpscluster.cli.report", "write RUN_DIR/report.html: where the time and the bytes of a run went"),
    "logs": ("vpscluster.cli.logs", "print what every node and rank of a run printed (--follow, --node, --rank, --tail)"),
    "attach": ("vpscluster.cli.attach", "follow a run started with `train --detach` until it ends (Ctrl-C leaves it running)"),
    "stop": ("vpscluster.cli.stop", "stop a run started with `train --detach`: a checkpoint first, then every process"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vpscluster",
        description="Turn a handful of rented machines into a cluster that trains language models together.",
    )
    parser.add_argument("--version", action="version", version=f"vpscluster {__version__}")
    add_subcommands(parser, COMMANDS, dest="command", metavar="COMMAND", attr="_module")
    return parser


def add_subcommands(parser: argparse.ArgumentParser, registry: dict[str, tuple[str, str]],
                    dest: str, metavar: str, attr: str) -> None:
    """One sub-parser per registry entry; each module fills its own arguments.

    The chosen module is stored on the namespace as `attr`. A module that does not exist (not
    built in this checkout) is simply not offered; any other import error is a real bug.
    """
    sub = parser.add_subparsers(dest=dest, metavar=metavar)
    sub.required = True
    for name, (module_name, help_text) in registry.items():
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            if e.name == module_name:
                continue
            raise
        p = sub.add_parser(name, help=help_text, description=help_text[0].upper() + help_text[1:] + ".")
        module.add_arguments(p)
        p.set_defaults(**{attr: module})


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args._argv = list(sys.argv[1:] if argv is None else argv)  # as typed (`train --detach` runs it again)
    try:
        try:
            return int(args._module.run(args) or 0)
        except KeyboardInterrupt:
            # Ctrl-C outside a launch (which handles it itself): nothing had started yet.
            raise Interrupted() from None
    except Interrupted as e:
        print(f"vpscluster {args.command}: {e}", file=sys.stderr)
        return e.exit_code
    except UserError as e:
        print(f"vpscluster {args.command}: error: {e}", file=sys.stderr)
        return e.exit_code
