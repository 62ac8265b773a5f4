"""`vpscluster vertical train|predict`: a model split by columns, towers on their nodes, joined by the queue.

    train --spec FILE [--data FILE] [--cluster FILE] [--run-dir DIR] [--json]
    train --example products [--staleness K] [--cluster FILE] [--json]
    predict --spec FILE --from RUN_DIR [--data FILE] [--cluster FILE] [--json]
"""

from __future__ import annotations

import argparse

from vpscluster.cli.output import add_json_flag, console, emit_json


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", metavar="ACTION")
    sub.required = True
    p = sub.add_parser("train", help="train the towers and the head (the spec's, or an example's)",
                       description="Train a vertically split model: each tower on its node and columns, the head "
                                   "fusing their embeddings, over NATS JetStream.")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--spec", metavar="FILE", help="the spec (YAML): towers, head, train settings")
    what.add_argument("--example", choices=["products"], help="generated data whose label needs both modalities")
    p.add_argument("--staleness", type=int, default=None, metavar="K",
                   help="with --example: a tower may run K batches ahead (default 0: synchronous)")
    _common(p)
    p = sub.add_parser("predict", help="predictions of a trained split for every row",
                       description="Run a trained split forward on every row; the head writes predictions.jsonl.")
    p.add_argument("--spec", metavar="FILE", required=True, help="the spec the run was trained with")
    p.add_argument("--from", dest="from_run", metavar="RUN_DIR", required=True, help="the trained run's directory")
    _common(p)


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data", metavar="FILE", help="JSON lines (default: the spec's data:)")
    p.add_argument("--cluster", metavar="FILE", help="cluster file (default: local processes on this machine)")
    p.add_argument("--run-dir", metavar="DIR", help="where the run's files go (default runs/vertical-<id>)")
    add_json_flag(p)


def run(args: argparse.Namespace) -> int:
    from vpscluster.cluster.inventory import load_cluster

    con = console(args.json)
    cluster = load_cluster(args.cluster) if args.cluster else None
    say = lambda line: con.print(line, markup=False, highlight=False, soft_wrap=True)  # noqa: E731 (stage lines hold [brackets])
    if args.action == "predict":
        from vpscluster.vertical import launch, spec

        doc = launch.predict(spec.load(args.spec), args.from_run, cluster, args.run_dir, args.data, say=say)
    elif args.example:
        from vpscluster.errors import UserError
        from vpscluster.vertical import example

        if args.data:
            raise UserError("--example generates its data; --data goes with --spec")
        doc = example.run(args.example, cluster, args.run_dir, staleness=args.staleness or 0, say=say)
    else:
        from vpscluster.errors import UserError
        from vpscluster.vertical import launch, spec

        if args.staleness is not None:
            raise UserError("--staleness goes with --example; a spec sets train.staleness")
        doc = launch.train(spec.load(args.spec), cluster, args.run_dir, args.data, say=say)
    if args.json:
        emit_json(doc)
    else:
        _render(con, doc)
    return 0


def _render(con, doc: dict) -> None:
    if "predictions" in doc:
        con.print(f"predictions of {doc['rows']} rows in {doc['predictions']}"
                  + (f"; accuracy {doc['accuracy']:.3f}" if doc.get("accuracy") is not None else ""))
        return
    once = "each sample exactly once per epoch" if doc["exactly_once"] else "SAMPLE COUNT WRONG"
    con.print(f"{doc['steps']} steps, K={doc['staleness']}, {doc['samples_per_s'] or 0:.0f} samples/s, "
              f"{doc['bytes_per_sample'] or 0:.0f} B/sample on the queue; {once}")
    for stage, n in (doc.get("restarts") or {}).items():
        con.print(f"stage {stage} died and resumed from its checkpoint {n} time(s)")
    for m in doc.get("moves") or []:
        con.print(f"stage {m['stage']} moved from {m['from']} (gone) to {m['to']} at step {m['step'] or 0}")
    if doc.get("val_accuracy") is not None:
        con.print(f"val accuracy (split, fused): {doc['val_accuracy']:.3f}")
    for name, acc in (doc.get("baselines") or {}).items():
        con.print(f"val accuracy ({name.replace('_', ' ')}, same head): {acc:.3f}")
    con.print(f"report: {doc['run_dir']}/report.json")
