"""`vpscluster batch`: run a Python function over partitioned data on every node (Dask).

    vpscluster batch --fn mymodule:score --input comments.jsonl --output out/ [--cluster FILE]
    vpscluster batch --example sentiment --output out/ [--rows N]

The function takes a list of rows (dicts) and returns a list of result rows (dicts); decorate
it with `vpscluster.jobs.dataframe_fn` to work on a pandas DataFrame. Without `--cluster` the
job runs on the local cluster (this machine).
"""

from __future__ import annotations

import argparse

from vpscluster.cli.output import add_json_flag


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cluster", metavar="FILE", help="the cluster file (default: the local cluster, this machine)")
    p.add_argument("--fn", metavar="MODULE:FUNCTION", help="the function to run on each partition")
    p.add_argument("--example", metavar="NAME", help="a bundled job instead of --fn: sentiment, perplexity")
    p.add_argument("--checkpoint", metavar="RUN_DIR", help="--example perplexity: a `vpscluster train` run directory")
    p.add_argument("--param", action="append", default=[], metavar="KEY=VALUE",
                   help="a keyword argument for the function (repeatable; values are strings; "
                        "_job.json and _manifest.json keep a digest of each value, never the value)")
    p.add_argument("--rows", type=int, default=1_000_000, metavar="N",
                   help="rows of generated input for --example when --input is not given (default 1000000)")
    p.add_argument("--input", metavar="PATH", help="a JSONL, CSV, Parquet or text file, or a folder of them")
    p.add_argument("--output", required=True, metavar="DIR",
                   help="one file per partition, written once; re-running skips finished partitions")
    p.add_argument("--code", metavar="DIR", help="the folder holding --fn's module, sent to every node "
                   "(default: the current folder); likely secrets in it (id_*, *.pem, *.key, .env, .ssh/ ...) "
                   "are never sent")
    p.add_argument("--partition-rows", type=int, default=10_000, metavar="N", help="rows per partition (default 10000)")
    p.add_argument("--retries", type=int, default=2, metavar="R", help="attempts after a failed one (default 2)")
    p.add_argument("--task-timeout", type=float, metavar="S",
                   help="a partition running longer than this fails and is retried on another node (--retries), "
                        "then the job stops naming it (default: no limit)")
    p.add_argument("--task-memory", type=float, metavar="MB",
                   help="a partition whose process uses more resident memory than this fails the job, naming it "
                        "(default: no limit; with either limit each partition runs in a child process of its worker)")
    p.add_argument("--on-error", choices=["fail", "skip"], default="fail",
                   help="a row the function raises on: stop the job (fail, default) or leave the row out (skip)")
    p.add_argument("--format", choices=["jsonl", "parquet"], default="jsonl", help="output files (default jsonl)")
    p.add_argument("--gpu", action="store_true", help="run only on nodes with a GPU (labels: {gpus: N})")
    p.add_argument("--max-load", type=float, default=0.8, metavar="FRACTION",
                   help="a node whose CPU is this busy with other work gets no new partitions (default 0.8)")
    p.add_argument("--no-admission", action="store_true", help="ignore node load (plain Dask placement)")
    p.add_argument("--insecure-network", action="store_true",
                   help="allow nodes on public addresses without the provisioned overlay (Dask's traffic is "
                        "unauthenticated, unencrypted TCP)")
    p.add_argument("--no-speculation", action="store_true", help="no backup copies of straggling partitions")
    p.add_argument("--workers-per-node", type=int, metavar="N",
                   help="Dask worker processes per node (default: its usable cores, at least 1)")
    add_json_flag(p)


def run(args: argparse.Namespace) -> int:
    from vpscluster.cli.output import console, emit_json
    from vpscluster.errors import UserError
    from vpscluster.jobs.run import BatchSpec, run_batch

    out = console(args.json)
    if bool(args.fn) == bool(args.example):
        raise UserError("give --fn MODULE:FUNCTION or --example NAME (one of them)")
    fn, input_path = args.fn, args.input
    params, ship = _params(args.param), {}
    if args.example:
        from vpscluster.jobs.examples import example, example_input, newest_checkpoint

        fn = example(args.example).fn
        if args.example == "perplexity":
            if not args.checkpoint:
                raise UserError("--example perplexity needs --checkpoint RUN_DIR (a `vpscluster train` run)")
            ship["checkpoint"], params["preset"] = newest_checkpoint(args.checkpoint)
        if input_path is None:
            if args.rows < 1:
                raise UserError(f"--rows {args.rows}: must be at least 1")
            out.print(f"generating {args.rows:,} input rows for the example (once; cached)")
            input_path = example_input(args.example, args.rows)
    if input_path is None:
        raise UserError("--input PATH is required with --fn")
    cluster = _cluster(args.cluster)
    if args.insecure_network:
        import dataclasses

        cluster = dataclasses.replace(cluster, insecure_network=True)
    spec = BatchSpec(fn=fn, input=input_path, output=args.output, partition_rows=args.partition_rows,
                     retries=args.retries, on_error=args.on_error, gpu=args.gpu, output_format=args.format,
                     code_dir=args.code, max_load=args.max_load, admission=not args.no_admission,
                     speculation=not args.no_speculation, workers_per_node=args.workers_per_node,
                     params=params, ship=ship, task_timeout_s=args.task_timeout, task_memory_mb=args.task_memory)
    view = BatchProgress(out)
    try:
        result = run_batch(spec, cluster, on_event=view.handle, say=lambda s: out.print(s, markup=False))
    finally:
        view.close()
    if args.json:
        emit_json(result.to_dict())
    else:
        summary(result, out)
    if not result.ok:
        raise UserError(result.error or result.teardown_error or "the job did not finish")
    return 0


def _params(items: list[str]) -> dict[str, str]:
    from vpscluster.errors import UserError

    params = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.isidentifier():
            raise UserError(f"--param {item}: write it as KEY=VALUE, KEY a Python name")
        params[key] = value
    return params


def _cluster(path: str | None):
    from vpscluster.cluster.inventory import load_cluster, local_cluster

    return load_cluster(path) if path else local_cluster()


class BatchProgress:
    """Partitions and rows done, rows/s, ETA and each node's share, from the job's events."""

    def __init__(self, console) -> None:
        self.console = console
        self.progress = None
        self.task = None
        self.rows = 0
        self.per_node: dict[str, int] = {}

    def handle(self, ev: dict) -> None:
        kind = ev.get("event")
        if kind == "start":
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            if ev["resumed"]:
                self.console.print(f"{ev['resumed']} of {ev['partitions']} partitions already done: skipped")
            self.progress = Progress(TextColumn("partitions"), MofNCompleteColumn(), BarColumn(bar_width=12),
                                     TextColumn("{task.fields[stats]}"), TextColumn("eta"),
                                     TimeRemainingColumn(compact=True), console=self.console)
            self.progress.start()
            self.task = self.progress.add_task("batch", total=ev["todo"], stats="starting Dask")
        elif kind == "done" and self.progress is not None:
            self.rows += ev["rows_in"]
            self.per_node[ev["node"]] = self.per_node.get(ev["node"], 0) + 1
            elapsed = self.progress.tasks[0].elapsed or 1e-9
            total = sum(self.per_node.values())
            share = " ".join(f"{n} {100 * c / total:.0f}%" for n, c in sorted(self.per_node.items()))
            self.progress.update(self.task, advance=1, stats=f"{self.rows:,} rows {self.rows / elapsed:,.0f} rows/s | {share}")
        elif kind in ("retry", "admission", "worker_lost") and self.progress is not None:
            text = {"retry": lambda: f"partition {ev['partition']}: attempt {ev['attempt']} failed, retrying: {ev['error']}",
                    "admission": lambda: f"node {ev['node']}: " + ("admitted again" if ev["admitted"] else
                                          f"busy with other work ({100 * (ev['foreign_load'] or 0):.0f}% CPU): no new partitions"),
                    "worker_lost": lambda: f"worker {ev['worker']} lost; Dask reruns its partition elsewhere"}[kind]()
            self.progress.console.print(text, style="yellow", markup=False)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
            self.progress = None


def summary(result, out) -> None:
    from rich.table import Table

    table = Table(title="batch job", show_header=False, title_justify="left")
    table.add_column("", style="bold")
    table.add_column("")
    rows = [
        ("partitions", f"{result.partitions_done} done, {result.partitions_resumed} from an earlier run, "
                       f"{result.partitions} in all"),
        ("rows", f"{result.rows_in:,} in, {result.rows_out:,} out" +
         (f", {len(result.rows_skipped)} skipped" if result.rows_skipped else "")),
        ("wall time", f"{result.wall_seconds:.1f} s ({result.rows_per_s:,.0f} rows/s)"),
        ("per node", ", ".join(f"{n}: {v['partitions']}" for n, v in result.per_node.items())),
        ("retries / backups", f"{result.retries} / {result.backups} ({result.backups_won} won)"),
        ("output", result.output),
    ]
    for k, v in rows:
        table.add_row(k, v)
    out.print(table)
