"""Gather node facts in parallel: run `vpscluster.nodeside.facts` with every node's configured Python.

A node that cannot be reached, or whose Python cannot run the script, becomes a record with
`reachable: False` and the reason, so the other nodes are still probed.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Callable, Sequence

from vpscluster import nodeside


@dataclass(frozen=True)
class FactsSettings:
    compute_seconds: float = 1.0  # >= ~1 s so a CPU quota (100 ms periods) is really felt
    disk_bytes: int = 64 << 20
    disk_budget_s: float = 3.0
    timeout_s: float = 90.0  # torch import + benchmarks on a slow, CPU-capped node


def _base(node) -> dict:
    return {"name": node.name, "host": node.host, "port": node.port, "python_path": node.python,
            "advertised_bandwidth_mbit": node.advertised_bandwidth_mbit}


async def gather_one(node, ex, settings: FactsSettings, overlay_interface: str | None = None) -> dict:
    opts = {"address": node.host, "workdir": node.workdir, "compute_seconds": settings.compute_seconds,
            "disk_bytes": settings.disk_bytes, "disk_budget_s": settings.disk_budget_s,
            "overlay_interface": overlay_interface}
    result = await ex.run(nodeside.command(node.python, "facts", json.dumps(opts)), timeout_s=settings.timeout_s)
    record = _base(node)
    data = nodeside.parse_json_output(result.stdout) if result.stdout else None
    if data is not None and result.ok:
        record.update(data)
        record["reachable"] = True
        return record
    record["reachable"] = False
    if result.error:
        record["error"] = result.error
    elif result.timed_out:
        record["error"] = f"node facts did not finish within {settings.timeout_s:.0f} s"
    elif result.exit_status in (126, 127):
        # The shell could not run the interpreter at all: it is the cluster file's `python` that is wrong.
        record["python_error"] = True
        record["error"] = f"python {node.python!r} cannot be run there (exit {result.exit_status})"
    else:
        record["python_error"] = True
        record["error"] = f"node facts failed with {node.python}: {result.reason()}"
    return record


async def gather_facts(nodes: Sequence, executors: dict, settings: FactsSettings,
                       on_node: Callable[[dict], None] | None = None, overlay_interface: str | None = None) -> list[dict]:
    async def one(n):
        record = await gather_one(n, executors[n.name], settings, overlay_interface)
        if on_node:
            on_node(record)
        return record

    return list(await asyncio.gather(*(one(n) for n in nodes)))
