"""`vpscluster queue up|down|status`: the message queue (NATS JetStream) of a cluster.

    up      nats-server on the head, bound to the cluster's (or overlay's) address, token required,
            streams on the head's disk; an exporter for Prometheus beside it
    down    stop it (streams and token kept; --purge removes them)
    status  whether it runs, where, its streams, message counts and each consumer's lag
"""

from __future__ import annotations

import argparse

from vpscluster.cli.output import add_json_flag, console, emit_json


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from vpscluster import telemetry as T

    sub = parser.add_subparsers(dest="action", metavar="ACTION")
    sub.required = True
    p = sub.add_parser("up", help="start nats-server (JetStream) on the head",
                       description="Start NATS JetStream on the head, on the cluster's address, with a token.")
    _cluster_flag(p)
    p.add_argument("--port", type=int, default=T.QUEUE_PORT, help=f"client port on the head (default {T.QUEUE_PORT})")
    p.add_argument("--monitor-port", type=int, default=T.QUEUE_MONITOR_PORT,
                   help=f"nats-server's monitoring port (default {T.QUEUE_MONITOR_PORT})")
    p.add_argument("--exporter-port", type=int, default=T.QUEUE_EXPORTER_PORT,
                   help=f"the Prometheus exporter's port (default {T.QUEUE_EXPORTER_PORT})")
    p.add_argument("--max-store", default="1GB", metavar="SIZE",
                   help="disk for all streams together (default 1GB; e.g. 500MB, 20GB)")
    p.add_argument("--nats-server", default="nats-server", metavar="PATH",
                   help="the nats-server binary on the head (default: nats-server on PATH)")
    add_json_flag(p)
    p = sub.add_parser("down", help="stop it (streams kept)", description="Stop the queue; its streams stay on disk.")
    _cluster_flag(p)
    p.add_argument("--purge", action="store_true", help="also remove the streams and the token")
    add_json_flag(p)
    p = sub.add_parser("status", help="whether it runs, its streams and their lag",
                       description="Whether the queue runs, where, its streams, message counts and consumer lag.")
    _cluster_flag(p)
    add_json_flag(p)


def _cluster_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cluster", metavar="FILE", help="cluster file (default: the local cluster, this machine)")


def _cluster(args):
    from vpscluster.cluster.inventory import load_cluster, local_cluster

    return load_cluster(args.cluster) if args.cluster else local_cluster()


def run(args: argparse.Namespace) -> int:
    return {"up": _up, "down": _down, "status": _status}[args.action](args)


def _size(text: str) -> int:
    from vpscluster.units import parse_size_bytes

    return int(parse_size_bytes(text, "--max-store"))


def _up(args) -> int:
    from vpscluster.queue import server

    con = console(args.json)
    rec = server.up(_cluster(args), port=args.port, monitor_port=args.monitor_port, exporter_port=args.exporter_port,
                    max_store=_size(args.max_store), nats_server=args.nats_server, say=con.print)
    if args.json:
        emit_json(rec.to_dict())
    else:
        con.print(f"queue up: NATS JetStream at {rec.url}; see it with `vpscluster queue status`, stop it with "
                  "`vpscluster queue down`")
    return 0


def _down(args) -> int:
    from vpscluster.queue import server

    con = console(args.json)
    stopped = server.down(_cluster(args), purge=args.purge, say=con.print)
    if args.json:
        emit_json({"stopped": stopped})
    elif not stopped and not args.purge:
        con.print("the queue was not running for this cluster")
    return 0


def _status(args) -> int:
    from vpscluster.queue import server

    doc = server.status(_cluster(args))
    if args.json:
        emit_json(doc)
        return 0
    con = console()
    if not doc["running"]:
        con.print("queue: not running" + (f" ({doc['note']})" if doc.get("note") else ""))
        return 0
    from rich.table import Table

    where = f" on {doc['head']} (streams in {doc['store_dir']})" if doc["managed"] else " (the cluster file's server)"
    con.print(f"NATS JetStream at {doc['url']}{where}; total lag {doc['lag']}")
    t = Table("stream", "messages", "bytes", "consumer", "lag", "unacked", "redelivered")
    for s in doc["streams"]:
        for i, c in enumerate(s["consumers"] or [None]):
            head = (s["name"], str(s["messages"]), str(s["bytes"])) if i == 0 else ("", "", "")
            t.add_row(*head, *((c["name"], str(c["lag"]), str(c["ack_pending"]), str(c["redelivered"])) if c else ("", "", "", "")))
    con.print(t)
    return 0
