"""`vpscluster provision`: tune and firewall every node of a cluster with Ansible, idempotently.

Exit status 0 when every node was provisioned (or, with --check, could be checked), 1 when a
node failed or was unreachable; 2 for a usage problem (one line).
"""

from __future__ import annotations

import argparse

from vpscluster.cli.output import add_json_flag


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cluster", metavar="FILE", required=True, help="cluster file of the nodes to provision")
    parser.add_argument("--check", action="store_true", help="show what would change; change nothing")
    parser.add_argument("--only", metavar="ROLES", default=None,
                        help="comma-separated roles to run: env,tcp,firewall,overlay (default: all)")
    parser.add_argument("--probe", metavar="FILE", default=None,
                        help="probe.json whose measured bandwidth-delay products size the TCP buffers (min 16 MB)")
    parser.add_argument("--timeout", type=float, default=900.0, metavar="SECONDS",
                        help="give up when the playbook has not finished after this long (default 900)")
    parser.add_argument("--accept-new-host-keys", action="store_true",
                        help="trust unknown SSH host keys on first use (recorded in known_hosts)")
    add_json_flag(parser)


def run(args: argparse.Namespace) -> int:
    import dataclasses
    import json
    from pathlib import Path

    from vpscluster.cli.output import console as make_console
    from vpscluster.cli.output import emit_json
    from vpscluster.cluster.inventory import load_cluster
    from vpscluster.errors import UserError
    from vpscluster.provision import parse_roles, provision

    if not args.timeout > 0:
        raise UserError(f"--timeout {args.timeout:g}: give a positive number of seconds")
    roles = parse_roles(args.only)
    cluster = load_cluster(args.cluster)
    if args.accept_new_host_keys:
        cluster = dataclasses.replace(cluster, accept_new_host_keys=True)
    probe = None
    if args.probe:
        try:
            probe = json.loads(Path(args.probe).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise UserError(f"--probe {args.probe}: cannot read a probe JSON ({e}); write one with "
                            f"`vpscluster probe --cluster {args.cluster} --out probe.json`") from None
    con = make_console(args.json)
    with con.status("provision: starting ansible-playbook", spinner="dots") as spinner:
        report = provision(cluster, roles=roles, check=args.check, timeout_s=args.timeout, probe=probe,
                           progress=lambda line: spinner.update(f"provision: {line[:100]}"))
    if args.json:
        emit_json(report)
        return 0 if report["ok"] else 1
    from rich.table import Table

    table = Table(title=f"provision {'--check ' if args.check else ''}{', '.join(report['roles'])}")
    for col in ("node", "status", *report["roles"]):
        table.add_column(col, no_wrap=True)
    for n in report["nodes"]:
        cells = []
        for r in report["roles"]:
            c = n["roles"].get(r, {})
            cells.append(f"{c.get('changed', 0)} changed, {c.get('ok', 0)} ok" + (f", {c['failed']} failed" if c.get("failed") else ""))
        table.add_row(n["name"], n["status"], *cells)
    con.print(table)
    for n in report["nodes"]:
        for line in n["changes"]:
            con.print(f"{n['name']}: {'would change' if args.check else 'changed'}: {line}", soft_wrap=True)
        for key, why in n["not_settable"].items():
            con.print(f"{n['name']}: {key}: {why}", soft_wrap=True)
        for line in n["notes"]:
            con.print(f"{n['name']}: note: {line}", soft_wrap=True)
        for line in n["errors"]:
            con.print(f"[red]{n['name']}: {line}[/red]", soft_wrap=True)
    con.print(f"provision: {report['summary']}")
    return 0 if report["ok"] else 1
