"""`vpscluster sandbox up|down|status`: an emulated WAN cluster on this machine (root).

    up      one network namespace per node on a bridge, tc-shaped links, cgroup CPU quotas,
            an sshd per node and a cluster.yaml to pass to every other command
    down    remove a sandbox (or those named --prefix P*, or --all): namespaces, links, cgroups,
            processes, files
    status  what exists and whether every node's sshd is alive
    set     change a running node's CPU share or link rate (rehearse a node that degrades)
    fault   inject a fault into a node (kill, reboot, stop, link-down, throttle, disk-full) or clear them
"""

from __future__ import annotations

import argparse

from vpscluster.cli.output import add_json_flag, console, emit_json

DEFAULT_NAME = "default"  # same as vpscluster.cluster.sandbox.DEFAULT_NAME, kept here so --help stays light


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", metavar="ACTION")
    sub.required = True

    p = sub.add_parser("up", help="build a sandbox and write its cluster file",
                       description="Build an emulated cluster: namespaces, shaped links, CPU quotas, an sshd per node.")
    p.add_argument("--name", default=DEFAULT_NAME, help=f"sandbox name, so several can live side by side (default {DEFAULT_NAME})")
    p.add_argument("--nodes", type=int, default=None, help="number of nodes (default 3, or what --regions adds up to)")
    p.add_argument("--bandwidth", default="1gbit",
                   help="link rate of every node, or one per node: 100mbit or 50mbit,200mbit,1gbit (default 1gbit); "
                        "with --regions, the rate inside a region")
    p.add_argument("--regions", default=None, metavar="SPEC",
                   help="nodes per region, in order: fra:2,lax:2 (each node's region goes to the cluster file's labels)")
    p.add_argument("--region-bandwidth", default=None, metavar="RATE",
                   help="rate between two nodes of different regions, e.g. 30mbit (default: as inside)")
    p.add_argument("--links", default=None, metavar="FILE",
                   help="rates per pair of nodes: lines src,dst,rate (node-1,node-3,30mbit), both directions "
                        "unless the reverse has its own line; over --region-bandwidth")
    p.add_argument("--cpu", default=None,
                   help="CPU share per node as a fraction of one core, or one per node: 0.45 or 1,0.5 (default unlimited)")
    p.add_argument("--latency", type=float, default=None, metavar="MS",
                   help="added round-trip time between nodes in ms (needs the kernel's netem)")
    p.add_argument("--own-root", action="store_true",
                   help="give each node its own filesystem (an overlay of this machine's /, removed by down)")
    add_json_flag(p)

    p = sub.add_parser("down", help="remove a sandbox and everything it made",
                       description="Remove a sandbox: processes, namespaces, links, cgroups and its state directory.")
    target = p.add_mutually_exclusive_group()
    target.add_argument("--name", default=DEFAULT_NAME, help=f"sandbox name (default {DEFAULT_NAME})")
    target.add_argument("--prefix", default=None, metavar="P",
                        help="remove only the sandboxes whose name starts with P (e.g. a test run's pt-)")
    target.add_argument("--all", action="store_true", help="remove every vpscluster sandbox on this machine")
    add_json_flag(p)

    p = sub.add_parser("status", help="show sandboxes, their nodes and whether each sshd is alive",
                       description="Show what sandboxes exist, their nodes, rates, CPU shares and sshd state.")
    p.add_argument("--name", default=None, help="only this sandbox (default: all)")
    add_json_flag(p)

    p = sub.add_parser("set", help="change a running node's CPU share or link rate",
                       description="Change a node while it runs: its cgroup CPU quota and/or its shaped link rate.")
    p.add_argument("--name", default=DEFAULT_NAME, help=f"sandbox name (default {DEFAULT_NAME})")
    p.add_argument("--node", required=True, help="the node to change, e.g. node-2")
    p.add_argument("--cpu", default=None, help="new CPU share, a fraction of one core (e.g. 0.15), or 'unlimited'")
    p.add_argument("--bandwidth", default=None, help="new link rate, e.g. 50mbit")
    p.add_argument("--peer", default=None, metavar="NODE",
                   help="with --bandwidth: change only the rate between --node and this node (both directions)")
    add_json_flag(p)

    p = sub.add_parser("fault", help="inject a fault into a node, or clear faults",
                       description="Inject a fault: kill | reboot | stop SECONDS | link-down SECONDS | throttle RATE SECONDS | "
                                   "disk-full [SECONDS]; or clear (every active fault, or the node's). Timed faults end "
                                   "by themselves, also after this command has exited.")
    p.add_argument("--name", default=DEFAULT_NAME, help=f"sandbox name (default {DEFAULT_NAME})")
    p.add_argument("--node", default=None, help="the node, e.g. node-2 (required except for clear)")
    p.add_argument("fault", nargs="+", metavar="KIND", help="kill | reboot | stop S | link-down S | throttle RATE S | disk-full [S] | clear")
    add_json_flag(p)


def run(args: argparse.Namespace) -> int:
    return {"up": _up, "down": _down, "status": _status, "set": _set, "fault": _fault}[args.action](args)


def _set(args: argparse.Namespace) -> int:
    from vpscluster.cluster import sandbox
    from vpscluster.errors import UserError

    if args.cpu is None and args.bandwidth is None:
        raise UserError("sandbox set: nothing to change; give --cpu SHARE and/or --bandwidth RATE")
    if args.peer is not None and args.bandwidth is None:
        raise UserError(f"sandbox set: --peer {args.peer} needs --bandwidth RATE (the new rate between the two nodes)")
    out: dict = {"name": args.name, "node": args.node}
    if args.cpu is not None:
        out["cpu"] = sandbox.set_cpu(args.name, args.node, args.cpu)
    if args.peer is not None:
        out["peer"] = args.peer
        out["bandwidth_mbit"] = sandbox.set_pair_rate(args.name, args.node, args.peer, args.bandwidth)
    elif args.bandwidth is not None:
        out["bandwidth_mbit"] = sandbox.set_rate(args.name, args.node, args.bandwidth)
    if args.json:
        emit_json(out)
        return 0
    changes = []
    if "cpu" in out:
        changes.append(f"cpu {_cpu(out['cpu'])}")
    if "bandwidth_mbit" in out:
        changes.append(f"bandwidth {_rate(out['bandwidth_mbit'])}" + (f" to and from {out['peer']}" if "peer" in out else ""))
    console().print(f"sandbox {args.name} {args.node}: {', '.join(changes)}")
    return 0


def _fault(args: argparse.Namespace) -> int:
    from vpscluster.cluster.sandbox import faults
    from vpscluster.errors import UserError

    kind, rest = args.fault[0], args.fault[1:]
    if kind == "clear":
        if rest:
            raise UserError(f"fault clear: takes no arguments (got {' '.join(rest)})")
        ended = faults.clear(args.name, args.node)
        if args.json:
            emit_json({"cleared": ended})
        else:
            console().print(f"cleared: {', '.join(f['node'] + ' ' + f['kind'] for f in ended)}" if ended else "no active faults")
        return 0
    if args.node is None:
        raise UserError(f"fault {kind}: needs --node NODE (e.g. --node node-2)")
    wants = {"kill": 0, "reboot": 0, "stop": 1, "link-down": 1, "throttle": 2, "disk-full": len(rest[:1])}.get(kind)
    if wants is None:
        raise UserError(f"fault: unknown kind {kind!r}; choose kill, reboot, stop, link-down, throttle, disk-full or clear")
    if len(rest) != wants:
        usage = {"kill": "kill", "reboot": "reboot", "stop": "stop SECONDS", "link-down": "link-down SECONDS",
                 "throttle": "throttle RATE SECONDS", "disk-full": "disk-full [SECONDS]"}[kind]
        raise UserError(f"fault {kind}: expected `{usage}`, got `{' '.join(args.fault)}`")
    rate = rest[0] if kind == "throttle" else None
    seconds = rest[-1] if rest and kind not in ("kill", "reboot") and not (kind == "throttle" and len(rest) < 2) else None
    record = faults.inject(args.name, args.node, kind, seconds=seconds, rate=rate)
    if args.json:
        emit_json(record)
    else:
        lasting = f" for {record['seconds']:g} s" if record.get("seconds") else ""
        console().print(f"sandbox {args.name}: {args.node}: {kind}{lasting}")
    return 0


def _up(args: argparse.Namespace) -> int:
    from vpscluster.cluster import sandbox

    con = console(args.json)
    with con.status(f"sandbox {args.name}: starting", spinner="dots") as spinner:
        info = sandbox.up(args.name, nodes=args.nodes, bandwidth=args.bandwidth, cpu=args.cpu, latency_ms=args.latency,
                          own_root=args.own_root, regions=args.regions, region_bandwidth=args.region_bandwidth,
                          links_file=args.links, progress=lambda msg: spinner.update(f"sandbox {args.name}: {msg}"))
    if args.json:
        emit_json(info.to_dict())
        return 0
    from rich.table import Table

    table = Table(title=f"sandbox {info.name}  ({info.subnet}, this machine is {info.gateway})")
    regions = any(n.region for n in info.nodes)
    for col in ("node", "address", "namespace", "bandwidth", "cpu") + (("region",) if regions else ()):
        table.add_column(col, no_wrap=True)
    for n in info.nodes:
        table.add_row(n.name, n.address, n.namespace, _rate(n.bandwidth_mbit), _cpu(n.cpu), *((n.region,) if regions else ()))
    con.print(table)
    if info.links:
        from vpscluster.cluster.sandbox.links import matrix

        con.print(_matrix_table(matrix(info), [n.name for n in info.nodes]))
    con.print(f"CPU limits: {_cgroup(info.cgroup)}", soft_wrap=True)
    con.print(f"cluster file: {info.cluster_file}", soft_wrap=True)
    con.print(f"try: vpscluster exec --cluster {info.cluster_file} -- hostname", soft_wrap=True)
    con.print(f"remove: vpscluster sandbox down --name {info.name}")
    return 0


def _down(args: argparse.Namespace) -> int:
    from vpscluster.cluster import sandbox

    if args.all:
        removed = sandbox.down_all()
    elif args.prefix is not None:
        removed = sandbox.down_prefix(args.prefix)
    else:
        removed = [args.name] if sandbox.down(args.name) else []
    if args.json:
        emit_json({"removed": removed})
    else:
        con = console()
        if removed:
            con.print(f"removed sandbox{'es' if len(removed) > 1 else ''}: {', '.join(removed)}")
        else:
            con.print("nothing to remove" if args.all else f"no sandbox named {args.prefix}*; nothing to remove"
                      if args.prefix is not None else f"no sandbox named {args.name!r}; nothing to remove")
    return 0


def _status(args: argparse.Namespace) -> int:
    from vpscluster.cluster import sandbox

    records = sandbox.status(args.name)
    if args.json:
        emit_json({"sandboxes": records})
        return 0
    con = console()
    if not records:
        con.print(f"no sandbox named {args.name!r}" if args.name else "no sandboxes")
        return 0
    from rich.table import Table

    for rec in records:
        table = Table(title=f"sandbox {rec['name']}: {rec['state']}" + (f"  ({rec['subnet']})" if rec.get("subnet") else ""))
        regions = any(n.get("region") for n in rec["nodes"])
        for col in ("node", "address", "namespace", "bandwidth", "cpu", "sshd") + (("region",) if regions else ()):
            table.add_column(col, no_wrap=True)
        for n in rec["nodes"]:
            ns = n["namespace"] if n["namespace_exists"] else f"[red]{n['namespace']} (missing)[/red]"
            if "address" not in n:  # a half-built sandbox: only its namespaces are known
                table.add_row(n["name"], "?", ns, "?", "?", "?", *(("?",) if regions else ()))
                continue
            sshd = f"pid {n['sshd_pid']}" if n["sshd_alive"] else "[red]dead[/red]"
            table.add_row(n["name"], n["address"], ns, _rate(n["bandwidth_mbit"]), _cpu(n["cpu"]), sshd,
                          *((n.get("region") or "-",) if regions else ()))
        con.print(table)
        if any(l["bandwidth_mbit"] != min(_port(rec, l["src"]), _port(rec, l["dst"])) for l in rec.get("links", [])):
            con.print(_matrix_table(rec["links"], [n["name"] for n in rec["nodes"]]))
        if rec.get("cgroup"):
            con.print(f"CPU limits: {_cgroup(rec['cgroup'])}", soft_wrap=True)
        if rec.get("cluster_file"):
            con.print(f"cluster file: {rec['cluster_file']}", soft_wrap=True)
        elif rec["state"] == "partial":
            con.print(f"half-built; remove it with: vpscluster sandbox down --name {rec['name']}")
    return 0


def _port(rec: dict, node: str) -> float:
    return next(n["bandwidth_mbit"] for n in rec["nodes"] if n["name"] == node)


def _matrix_table(matrix: list[dict], names: list[str]):
    """The shaped rate of every ordered pair (row -> column)."""
    from rich.table import Table

    rates = {(l["src"], l["dst"]): l["bandwidth_mbit"] for l in matrix}
    table = Table(title="link rates (row -> column)")
    table.add_column("", no_wrap=True)
    for name in names:
        table.add_column(name, no_wrap=True)
    for src in names:
        table.add_row(src, *("-" if src == dst else _rate(rates[(src, dst)]) for dst in names))
    return table


def _rate(mbit: float) -> str:
    from vpscluster.cluster.sandbox.clusterfile import format_rate

    return format_rate(mbit)


def _cpu(share: float | None) -> str:
    return "unlimited" if share is None else f"{share:g}"


def _cgroup(version: str | None) -> str:
    files = {"v1": "cpu.cfs_quota_us", "v2": "cpu.max"}
    return f"cgroup {version} ({files[version]})" if version in files else "unknown"
