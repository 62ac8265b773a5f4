"""One stage of a vertical split, as a process on a node (started by `vertical.launch`).

    python -m vpscluster.vertical.worker tower NAME --spec SPEC.json --rows FILE --run RUN --out DIR
    python -m vpscluster.vertical.worker head --spec SPEC.json --rows FILE --run RUN --out DIR
    ... [--weights FILE]    (a trained stage's state: predict every row instead of training)
    ... [--resume]          (a stage started again: from its checkpoint in --out)
    ... tower NAME --replica R --ids FILE ...   (replica R of a tower with several; FILE: every sample id)

The queue comes from the VPSC_QUEUE_* environment the launcher sets (`queue.Credentials.env`).
`--rows` is the only data this process gets: its columns (a tower) or the labels (the head).
A problem is one line on stderr and exit status 2; the head's report is its last stdout line.
"""

from __future__ import annotations

import argparse
import json
import sys

from vpscluster.errors import UserError


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="vpscluster.vertical.worker")
    p.add_argument("role", choices=["tower", "head"])
    p.add_argument("name", nargs="?")
    p.add_argument("--spec", required=True)
    p.add_argument("--rows", required=True)
    p.add_argument("--run", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--weights", help="a trained stage's state: predict instead of training")
    p.add_argument("--replica", type=int, help="a tower with replicas: this process's index (0, 1, ...)")
    p.add_argument("--ids", help="a tower's replica: every sample id (its --rows are its share only)")
    p.add_argument("--resume", action="store_true", help="go on from this stage's checkpoint in --out")
    args = p.parse_args(argv)
    try:
        from vpscluster import queue
        from vpscluster.vertical import head, spec as spec_mod, tower

        with open(args.spec) as f:
            spec = spec_mod.from_dict(json.load(f), args.spec)
        if args.role == "tower" and args.name not in spec.towers:
            raise UserError(f"no tower {args.name!r} in {args.spec}")
        say = lambda line: print(line, flush=True)  # noqa: E731
        with queue.connect(timeout_s=spec.train.timeout_s) as q:
            if args.role == "tower":
                doc = tower.run(spec, args.name, args.rows, args.run, args.out, q, say, args.weights, args.resume,
                                args.replica, args.ids)
            else:
                doc = head.run(spec, args.rows, args.run, args.out, q, say, args.weights, args.resume)
        print(json.dumps(doc), flush=True)
        return 0
    except UserError as e:
        stage = f"{args.name}.{args.replica}" if args.replica is not None else args.name
        print(f"{args.role}{' ' + stage if stage else ''}: error: {e}", file=sys.stderr, flush=True)
        return 2


if __name__ == "__main__":
    sys.exit(main())
