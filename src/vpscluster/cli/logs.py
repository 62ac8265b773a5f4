"""`vpscluster logs RUN`: what every node and rank of a run printed, from RUN_DIR/logs/.

Any run — in progress (detached or not), finished or failed. Lines are shown as the live view
shows them, with the time they arrived: `HH:MM:SS node/rank: text` (`node/launcher` for the
launcher's remarks, plain `node` for torchrun's agent), node by node. `--node` and `--rank` pick
sources, `--tail N` keeps the last N lines of each node, `--grep TEXT` the lines containing TEXT.
`--follow` then keeps printing new lines as they arrive, from every node, until a detached run's
launcher has ended, or until Ctrl-C.
"""

from __future__ import annotations

import argparse
import sys
import time

POLL_S = 0.5


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run", metavar="RUN", help="the run directory, or its run id under runs/")
    parser.add_argument("--node", action="append", metavar="NODE", help="only this node (repeatable)")
    parser.add_argument("--rank", action="append", type=int, metavar="N", help="only this global rank (repeatable)")
    parser.add_argument("-n", "--tail", type=int, metavar="N", help="only the last N lines of each node")
    parser.add_argument("--grep", metavar="TEXT", help="only lines containing TEXT")
    parser.add_argument("-f", "--follow", action="store_true",
                        help="keep printing new lines until the run's launcher ends (detached runs) or Ctrl-C")


def run(args: argparse.Namespace) -> int:
    from collections import deque

    from vpscluster.errors import UserError
    from vpscluster.launch import detached
    from vpscluster.launch.logs import FileTail, node_logs, read_log_line
    from vpscluster.train import rundir

    run_dir = rundir.find(args.run)
    state = detached.read_state(run_dir)
    if state and state.get("controller"):  # the logs are on the controller node: print them from there
        from vpscluster.launch import controller

        argv = ["logs", state["remote_run_dir"]] + [a for n in args.node or () for a in ("--node", n)]
        argv += [a for r in args.rank or () for a in ("--rank", str(r))]
        argv += (["--tail", str(args.tail)] if args.tail is not None else []) + (["--grep", args.grep] if args.grep else [])
        argv += ["--follow"] if args.follow else []
        try:
            return controller.remote_cli(state, argv, timeout_s=30 * 86400.0 if args.follow else 600.0)
        except KeyboardInterrupt:
            return 0
    if args.tail is not None and args.tail < 0:
        raise UserError(f"--tail {args.tail}: give a number of lines >= 0")
    logs = node_logs(run_dir / rundir.LOGS)
    if args.node:
        unknown = [n for n in args.node if n not in logs]
        if unknown:
            known = ", ".join(logs) or "none yet"
            raise UserError(f"--node {', '.join(unknown)}: no log of that node in {run_dir / rundir.LOGS} "
                            f"(nodes with logs: {known})")
        logs = {n: p for n, p in logs.items() if n in args.node}
    ranks = {f"/{r}" for r in args.rank or ()}

    def shown(line: str) -> str | None:
        parsed = read_log_line(line)
        if parsed is None:
            return None if ranks else line  # a line of another form has no rank to match
        at, who, _stream, text = parsed
        if ranks and not any(who.endswith(r) for r in ranks):
            return None
        if args.grep and args.grep not in text:
            return None
        return f"{at} {who}: {text}"

    tails = {}
    for name, path in logs.items():  # read as a stream: a long run's logs need not fit in memory
        keep: deque[str] = deque(maxlen=args.tail)
        offset = 0
        with path.open("rb") as f:
            for raw in f:
                if not raw.endswith(b"\n"):  # a line still being written: --follow prints it once complete
                    break
                offset += len(raw)
                out = shown(raw[:-1].decode(errors="replace"))
                if out is not None:
                    if args.tail is None:
                        print(out)
                    else:
                        keep.append(out)
        for out in keep:
            print(out)
        tails[name] = FileTail(path, offset)
    sys.stdout.flush()
    if not args.follow:
        if not logs:
            print(f"{run_dir}: no node has written a log yet", file=sys.stderr)
        return 0
    state = detached.read_state(run_dir)
    print(f"following {run_dir} ({'until its launcher ends' if state else 'Ctrl-C to stop'})", file=sys.stderr)
    try:
        while True:
            alive = state is not None and detached.running(detached.read_state(run_dir) or {})
            for name, path in node_logs(run_dir / rundir.LOGS).items():  # a node's log may appear later
                if name not in tails and (not args.node or name in args.node):
                    tails[name] = FileTail(path)
            for tail in tails.values():
                for line in tail.lines():
                    out = shown(line)
                    if out is not None:
                        print(out, flush=True)
            if state is not None and not alive:
                print(f"run {run_dir}: {detached.describe_end(detached.read_state(run_dir) or {})}", file=sys.stderr)
                return 0
            time.sleep(POLL_S)
    except KeyboardInterrupt:
        return 0
