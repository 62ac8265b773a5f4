"""`vpscluster exec [--cluster FILE] [--timeout S] [--accept-new-host-keys] [--json] -- COMMAND...`

Runs one shell command on every node in parallel. Output lines appear live, prefixed with the
node name; a per-node status table (node, exit, seconds, error) follows. The exit status is
non-zero when any node failed, timed out or could not be reached.

One word after `--` is a shell command line used as written (`-- 'nproc; free -g'`); several
words are quoted one by one, so `-- python3 -c 'print(1)'` reaches the node unchanged.
Without --cluster the command runs on the local cluster (this machine).

--json prints {"results": [{"node", "exit_status", "stdout", "stderr", "duration_s",
"timed_out", "error"}]} on stdout; the live lines and the table go to stderr then.
"""

from __future__ import annotations

import argparse

from vpscluster.cli.output import add_json_flag
from vpscluster.errors import UserError

_NODE_STYLES = ("cyan", "magenta", "green", "yellow", "blue", "bright_cyan", "bright_magenta", "bright_green")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cluster", metavar="FILE", help="cluster file (cluster.yaml); default: this machine only")
    parser.add_argument("--timeout", type=float, metavar="S",
                        help="seconds each node may take (default: command_timeout_s of the cluster file, else 60)")
    parser.add_argument("--accept-new-host-keys", action="store_true",
                        help="trust hosts not yet in known_hosts and record their keys (a changed key is still refused)")
    parser.add_argument("--insecure-network", action="store_true",
                        help="run even over public addresses without an overlay (what the command starts may listen unauthenticated)")
    add_json_flag(parser)
    parser.add_argument("words", nargs=argparse.REMAINDER, metavar="-- COMMAND...",
                        help="the command to run on every node")


def command_line(words: list[str]) -> str:
    """One word: a shell command line as written; several: each word quoted."""
    import shlex

    words = words[1:] if words and words[0] == "--" else words
    if not words or not "".join(words).strip():
        raise UserError("no command given; put it after --, e.g. vpscluster exec -- hostname")
    return words[0] if len(words) == 1 else shlex.join(words)


def run(args: argparse.Namespace) -> int:
    import asyncio
    import dataclasses

    from vpscluster.cli.output import console, emit_json
    from vpscluster.cluster.inventory import load_cluster, local_cluster

    command = command_line(args.words)
    cluster = load_cluster(args.cluster) if args.cluster else local_cluster()
    if not args.insecure_network:  # refused before any node is reached, in one line
        from vpscluster.cluster import netsafety

        netsafety.require_safe_network(cluster, netsafety.EXEC, action="run `exec`")
    if args.accept_new_host_keys:
        cluster = dataclasses.replace(cluster, accept_new_host_keys=True)
    timeout_s = args.timeout if args.timeout is not None else cluster.command_timeout_s
    if timeout_s <= 0:
        raise UserError(f"--timeout: {timeout_s:g} must be a positive number of seconds")

    out = console(args.json)
    results = asyncio.run(exec_on_all(cluster, command, timeout_s, out))
    render_table(out, results, timeout_s)
    if args.json:
        emit_json({"results": [dataclasses.asdict(r) for r in results]})
    return 0 if all(r.ok for r in results) else 1


async def exec_on_all(cluster, command: str, timeout_s: float, out) -> list:
    """Stream `command` on every node at once, printing each line with its node's prefix."""
    from rich.text import Text

    from vpscluster.cluster.executor import fan_out
    from vpscluster.cluster.inventory import open_executors

    width = max(len(n.name) for n in cluster.nodes)
    styles = {n.name: _NODE_STYLES[i % len(_NODE_STYLES)] for i, n in enumerate(cluster.nodes)}

    def printer(node: str):
        prefix = Text(f"{node:<{width}} | ", style=styles[node])

        def on_line(stream: str, line: str) -> None:
            body = Text(line, style="red" if stream == "stderr" else "")
            out.print(prefix + body, soft_wrap=True, highlight=False)

        return on_line

    async def one(ex):
        result = await ex.stream(command, printer(ex.node.name), timeout_s)
        if result.error:
            out.print(Text(f"{ex.node.name:<{width}} | ", style=styles[ex.node.name]) +
                      Text(_without_node(result.error, ex.node.name), style="bold red"), soft_wrap=True, highlight=False)
        return result

    async with open_executors(cluster) as executors:
        return await fan_out(executors, one)


def render_table(out, results: list, timeout_s: float) -> None:
    from rich.table import Table

    table = Table(title=None, show_edge=False, pad_edge=False)
    for column, justify in (("node", "left"), ("exit", "right"), ("seconds", "right"), ("error", "left")):
        table.add_column(column, justify=justify)
    for r in results:
        if r.timed_out:
            exit_text, error = "-", f"timed out after {timeout_s:g} s"
        elif r.exit_status is None:
            exit_text, error = "-", r.error or "no exit status"
        else:
            exit_text, error = str(r.exit_status), r.error or ""
        error = _without_node(error, r.node)
        style = "green" if r.ok else "red"
        table.add_row(r.node, f"[{style}]{exit_text}[/]", f"{r.duration_s:.2f}", _escape(error))
    out.print(table)
    failed = sum(not r.ok for r in results)
    summary = f"{len(results) - failed}/{len(results)} nodes succeeded"
    out.print(f"[{'red' if failed else 'green'}]{summary}[/]", highlight=False)


def _without_node(error: str, node: str) -> str:
    """Errors start with the node's name for logs; beside the name column it would be said twice."""
    return error[len(node) + 2:] if error.startswith(f"{node}: ") else error


def _escape(text: str) -> str:
    from rich.markup import escape

    return escape(text)
