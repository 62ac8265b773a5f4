"""The vertical split's pipelining: staleness K = 0 (synchronous) against K >= 1, side by side.

    run_vertical_bench(VerticalBenchSettings(...), say=print) -> results document
    (CLI: `vpscluster bench vertical`)

The products example (text tower, image tower, fusion head; vertical/products.py) on a sandbox
of `nodes` nodes at `bandwidth` (the head and the queue on node-1, the towers on node-2 and
node-3), or with `local` on this machine's processes and a private nats-server. The same data,
seeds and steps for every K, run one after the other in one invocation; each row gives samples/s
(head's training time, the towers' start-up excluded), the ratio to K = 0, bytes per sample on
the queue, the validation accuracy (what staleness costs in accuracy), the sample-id check, the
share of the training time the head waited on the towers and the head's CPU share (where the
limit is), and the bytes per sample whole-model DDP on the same nodes would send (computed from
the parameter count). `dim`, `image_hidden` and `image_depth` size the model (default: the example's).
Results: `out` (default bench/results/vertical-<time>/): results.json, table.md, every run's files.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

from vpscluster.bench import table

COLUMNS = [("staleness", "K", "{}"), ("samples_per_s", "samples/s", "{:.0f}"), ("speedup", "vs K=0", "{:.2f}x"),
           ("bytes_per_sample", "queue B/sample", "{:.0f}"), ("val_accuracy", "val accuracy", "{:.3f}"),
           ("final_train_loss", "final train loss", "{:.4f}"), ("head_wait_share", "head waits", "{:.0%}"),
           ("head_cpu_share", "head CPU", "{:.0%}"),
           ("exactly_once", "each sample once", "{}"), ("ddp_bytes_per_sample", "DDP B/sample (computed)", "{:.0f}")]


@dataclass
class VerticalBenchSettings:
    staleness: str = "0,1,2"  # the K of each run, in order
    nodes: int = 3
    bandwidth: str = "100mbit"
    latency_ms: float = 0.0
    rows: int = 2000
    epochs: int = 4
    dim: int = 16  # each tower's embedding width
    image_hidden: int = 32  # the image tower's hidden width ...
    image_depth: int = 1  # ... and its hidden layers: a bigger tower, to see what pipelining hides
    local: bool = False  # this machine's processes and a private nats-server, no sandbox
    name: str = "vertical-bench"
    out: str | None = None


def run_vertical_bench(settings: VerticalBenchSettings, say: Callable[[str], None] = lambda line: None) -> dict[str, Any]:
    from vpscluster.errors import UserError
    from vpscluster.vertical import example

    s = settings
    try:
        ks = [int(k) for k in s.staleness.split(",")]
    except ValueError:
        raise UserError(f"--staleness {s.staleness!r}: give K values like 0,1,2") from None
    if not ks or min(ks) < 0:
        raise UserError("--staleness: give K >= 0 values like 0,1,2")
    out = Path(s.out or Path("bench") / "results" / time.strftime("vertical-%Y%m%d-%H%M%S", time.gmtime())).resolve()
    out.mkdir(parents=True, exist_ok=True)
    cluster, close = _cluster(s, say)
    rows: list[dict[str, Any]] = []
    try:
        for k in ks:
            say(f"K={k}: {s.rows} rows, {s.epochs} epochs")
            doc = example.run("products", cluster, out / f"k{k}", staleness=k, rows=s.rows, epochs=s.epochs,
                              baselines=False, say=lambda line: None,
                              dim=s.dim, image_hidden=s.image_hidden, image_depth=s.image_depth)
            rows.append({key: doc.get(key) for key in ("staleness", "steps", "samples_per_s", "bytes_per_sample",
                                                       "val_accuracy", "final_train_loss", "exactly_once", "train_seconds",
                                                       "head_wait_share", "head_cpu_share")})
            say(f"  {doc['samples_per_s']:.0f} samples/s, val accuracy {doc['val_accuracy']:.3f}")
    finally:
        close()
    base = next((r["samples_per_s"] for r in rows if r["staleness"] == 0), None)
    ddp = ddp_bytes_per_sample(s)
    for r in rows:
        r["speedup"] = r["samples_per_s"] / base if base else None
        r["ddp_bytes_per_sample"] = ddp
    where = "this machine (local processes)" if s.local else f"sandbox: {s.nodes} nodes x {s.bandwidth}" + (
        f", {s.latency_ms:g} ms" if s.latency_ms else "")
    doc = {"command": "vpscluster bench vertical " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in asdict(s).items() if k not in ("out", "local", "name")) + (
        " --local" if s.local else ""), "where": where, "rows": rows, "results_dir": str(out)}
    (out / "results.json").write_text(json.dumps(doc, indent=1) + "\n")
    (out / "table.md").write_text(markdown(doc) + "\n")
    return doc


def ddp_bytes_per_sample(s: VerticalBenchSettings, batch_size: int = 64) -> float:
    """What whole-model DDP on the same nodes would send per sample: a ring all-reduce of every
    parameter (float32) per step, 2 (n - 1) / n of the gradient from each of the n nodes, over a
    global batch of `batch_size` (the split's). Computed from the model's parameter count, not run."""
    from vpscluster.vertical import products

    params = sum(p.numel() for m in (products.text_tower(s.dim), products.image_tower(s.dim, s.image_hidden, s.image_depth),
                                     products.fusion_head((s.dim, s.dim))) for p in m.parameters())
    n = 1 if s.local else s.nodes
    return 2 * (n - 1) * 4 * params / batch_size


def _cluster(s: VerticalBenchSettings, say) -> tuple[Any, Callable[[], None]]:
    """(the cluster, its teardown): None for local; else a sandbox with `queue up` on its head."""
    if s.local:
        return None, lambda: None
    from vpscluster.cluster import sandbox
    from vpscluster.cluster.inventory import load_cluster
    from vpscluster.queue import server

    info = sandbox.up(s.name, nodes=s.nodes, bandwidth=s.bandwidth, latency_ms=s.latency_ms or None,
                      progress=lambda m: say(f"  {m}"))
    try:
        cluster = load_cluster(info.cluster_file)
        server.up(cluster, say=say)
    except BaseException:
        sandbox.down(s.name)
        raise

    def close() -> None:
        try:
            server.down(cluster, purge=True)
        finally:
            sandbox.down(s.name)
    return cluster, close


def markdown(doc: dict[str, Any]) -> str:
    return f"Command: `{doc['command']}` ({doc['where']}).\n\n" + table.markdown(doc["rows"], COLUMNS)
