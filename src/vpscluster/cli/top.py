"""`vpscluster top`: a live view of every node and the current run, read from the cluster's
Prometheus (`vpscluster monitor up`); `--json` prints one snapshot."""

from __future__ import annotations

import argparse

from vpscluster.cli.output import add_json_flag


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cluster", metavar="FILE", help="cluster file (default: the local cluster, this machine)")
    parser.add_argument("--interval", type=float, default=2.0, metavar="SECONDS", help="refresh every (default 2)")
    parser.add_argument("--window", default="30s", help="rates and averages over this Prometheus range (default 30s)")
    add_json_flag(parser)


def run(args: argparse.Namespace) -> int:
    import time

    from vpscluster.cli.output import console, emit_json
    from vpscluster.cluster.inventory import load_cluster, local_cluster
    from vpscluster.monitor.top import render, snapshot

    cluster = load_cluster(args.cluster) if args.cluster else local_cluster()
    if args.json:
        emit_json(snapshot(cluster, args.window))
        return 0
    from rich.live import Live

    with Live(render(snapshot(cluster, args.window)), console=console(), auto_refresh=False) as live:
        try:
            while True:
                time.sleep(max(0.2, args.interval))
                live.update(render(snapshot(cluster, args.window)), refresh=True)
        except KeyboardInterrupt:
            return 0
