"""`vpscluster probe`: measure every node and every link of a cluster; report problems and fixes.

Exit status 0 when no problem of severity "error" was found, 1 otherwise (so scripts can gate
on it); the probe is saved either way for `plan` and `train`/`run`.
"""

from __future__ import annotations

import argparse

from vpscluster.cli.output import add_json_flag


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cluster", metavar="FILE", help="cluster file (default: the local cluster, this machine)")
    parser.add_argument("--quick", action="store_true",
                        help="fast sanity check: short link tests and compute benchmark, no all-reduce sweep")
    parser.add_argument("--out", metavar="FILE", help="also write the probe JSON to FILE")
    parser.add_argument("--rtt-threshold-ms", type=float, default=20.0, metavar="MS",
                        help="flag links with a higher round-trip time (default: 20)")
    parser.add_argument("--streams", type=int, default=1, metavar="N",
                        help="parallel TCP streams per bandwidth test (default: 1)")
    sweep = parser.add_mutually_exclusive_group()
    sweep.add_argument("--sweep", dest="sweep", action="store_true", default=None,
                       help="run the all-reduce sweep even with --quick")
    sweep.add_argument("--no-sweep", dest="sweep", action="store_false", help="skip the all-reduce sweep")
    parser.add_argument("--accept-new-host-keys", action="store_true",
                        help="trust unknown SSH host keys on first use (recorded in known_hosts)")
    parser.add_argument("--insecure-network", action="store_true",
                        help="probe even over public addresses without an overlay (its link tests and all-reduce are unauthenticated)")
    add_json_flag(parser)


def run(args: argparse.Namespace) -> int:
    import dataclasses
    from pathlib import Path

    from vpscluster.cli.output import console as make_console
    from vpscluster.cli.output import emit_json
    from vpscluster.cluster.inventory import load_cluster, local_cluster
    from vpscluster.errors import UserError
    from vpscluster.probe.api import run_probe
    from vpscluster.probe.problems import Thresholds
    from vpscluster.probe.report import render
    from vpscluster.probe.store import write_json

    if args.streams < 1 or args.streams > 64:
        raise UserError(f"--streams {args.streams}: give 1 to 64 parallel streams")
    if args.rtt_threshold_ms <= 0:
        raise UserError(f"--rtt-threshold-ms {args.rtt_threshold_ms:g}: give a positive number of milliseconds")
    cluster = load_cluster(args.cluster) if args.cluster else local_cluster()
    if not args.insecure_network:  # refused before any node is reached, in one line
        from vpscluster.cluster import netsafety

        netsafety.require_safe_network(cluster, netsafety.PROBE, action="probe")
    if args.accept_new_host_keys:
        cluster = dataclasses.replace(cluster, accept_new_host_keys=True)
    console = make_console(args.json)

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    labels = {"nodes": "node facts", "links": "link tests (round-robin steps)", "collectives": "all-reduce sweep"}
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, transient=False) as bar:
        tasks: dict[str, int] = {}

        def progress(task: str, done: int, total: int) -> None:
            if task not in tasks:
                tasks[task] = bar.add_task(labels.get(task, task), total=max(total, 1))
            bar.update(tasks[task], completed=done if total else 1, total=max(total, 1))

        probe = run_probe(cluster, quick=args.quick, streams=args.streams,
                          thresholds=Thresholds(rtt_ms=args.rtt_threshold_ms), sweep=args.sweep, progress=progress)
    if args.out:
        try:
            write_json(Path(args.out), probe)
        except OSError as e:
            raise UserError(f"--out {args.out}: cannot write it ({e.strerror}); choose a writable path") from None
    if args.json:
        emit_json(probe)
    else:
        render(probe, console)
    return 1 if any(p["severity"] == "error" for p in probe["problems"]) else 0
