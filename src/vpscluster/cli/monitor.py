"""`vpscluster monitor up|down|status|dashboard`: a real Prometheus server for a cluster.

    up         node exporters on every node, Prometheus on the head scraping them and the
               current run's ranks (file-based discovery: a new run needs no restart)
    down       stop them all and check they are gone
    status     where it runs and whether every target is up
    dashboard  a Grafana dashboard (JSON) over the same metric names, on stdout
"""

from __future__ import annotations

import argparse

from vpscluster.cli.output import add_json_flag, console, emit_json


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from vpscluster import telemetry as T

    sub = parser.add_subparsers(dest="action", metavar="ACTION")
    sub.required = True
    p = sub.add_parser("up", help="start node exporters and Prometheus on the head",
                       description="Start a node exporter on every node and Prometheus on the head.")
    _cluster_flag(p)
    p.add_argument("--port", type=int, default=T.PROMETHEUS_PORT, help=f"Prometheus port on the head (default {T.PROMETHEUS_PORT})")
    p.add_argument("--scrape-interval", type=float, default=5.0, metavar="SECONDS", help="how often every target is scraped (default 5)")
    p.add_argument("--prometheus", default="prometheus", metavar="PATH", help="the Prometheus binary on the head (default: prometheus on PATH)")
    p.add_argument("--node-exporter", choices=("builtin", "debian", "auto"), default="builtin",
                   help="builtin: vpscluster's own (CPU over the node's cgroup quota); debian: Debian's "
                        f"prometheus-node-exporter on port {T.DEBIAN_NODE_PORT} (standard node_* metrics; CPU from "
                        "/proc/stat, right on a VM); auto: debian where installed, else builtin (default builtin)")
    p.add_argument("--debian-port", type=int, default=T.DEBIAN_NODE_PORT, metavar="PORT",
                   help=f"port of Debian's node exporter on every node (default {T.DEBIAN_NODE_PORT})")
    p.add_argument("--insecure-network", action="store_true",
                   help="start even over public addresses without an overlay (Prometheus and the exporters are unauthenticated)")
    add_json_flag(p)
    for name, text in (("down", "stop Prometheus and the node exporters"), ("status", "where monitoring runs and the health of every target")):
        p = sub.add_parser(name, help=text, description=text[0].upper() + text[1:] + ".")
        _cluster_flag(p)
        add_json_flag(p)
    sub.add_parser("dashboard", help="print a Grafana dashboard (JSON) over vpscluster's metrics",
                   description="Print a Grafana dashboard (JSON) generated from the metric definitions.")


def _cluster_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cluster", metavar="FILE", help="cluster file (default: the local cluster, this machine)")


def _cluster(args):
    from vpscluster.cluster.inventory import load_cluster, local_cluster

    return load_cluster(args.cluster) if args.cluster else local_cluster()


def run(args: argparse.Namespace) -> int:
    return {"up": _up, "down": _down, "status": _status, "dashboard": _dashboard}[args.action](args)


def _up(args) -> int:
    from vpscluster.monitor import server

    from vpscluster.cluster import netsafety

    cluster = _cluster(args)
    if not args.insecure_network:  # refused before anything is started, in one line
        netsafety.require_safe_network(cluster, netsafety.MONITOR, action="start monitoring")
    con = console(args.json)
    rec = server.up(cluster, port=args.port, scrape_interval_s=args.scrape_interval, prometheus=args.prometheus,
                    say=con.print, node_exporter=args.node_exporter,
                    debian_port=args.debian_port)
    if args.json:
        emit_json(rec)
    else:
        con.print(f"monitoring up: Prometheus at {rec.url}; watch with `vpscluster top`, stop with `vpscluster monitor down`")
    return 0


def _down(args) -> int:
    from vpscluster.monitor import server

    con = console(args.json)
    stopped = server.down(_cluster(args), say=con.print)
    if args.json:
        emit_json({"stopped": stopped})
    elif not stopped:
        con.print("monitoring was not running for this cluster")
    return 0


def _status(args) -> int:
    from vpscluster.monitor import server

    doc = server.status(_cluster(args))
    if args.json:
        emit_json(doc)
        return 0
    con = console()
    if not doc["running"]:
        con.print("monitoring: not running" + (f" ({doc['note']})" if doc.get("note") else ""))
        return 0
    from rich.table import Table

    con.print(f"Prometheus at {doc['url']} on {doc['head']} (data in {doc['monitor_dir']}/data)")
    t = Table("target", "node", "exporter", "health", "last error")
    for target in doc["targets"]:
        lab = target["labels"]
        style = "green" if target["health"] == "up" else "red"
        t.add_row(target["url"], lab.get("node", ""), lab.get("exporter", "") + (f" rank {lab['rank']}" if "rank" in lab else ""),
                  f"[{style}]{target['health']}[/]", target["error"])
    con.print(t)
    return 0


def _dashboard(args) -> int:
    from vpscluster.monitor.dashboard import dashboard

    emit_json(dashboard())
    return 0
