"""The link matrix: RTT and bandwidth for every ordered pair of nodes, in round-robin rounds.

Pairs are scheduled with the circle method of round-robin tournaments (Kirkman 1847; the usual
"Berger tables"): fix one node, rotate the others, and each of the N-1 rounds (N for odd N, one
node resting per round) pairs every node with a different partner. Every round is measured in
two steps, a->b for all its pairs at once and then b->a, so no node is in two tests at a time and
the whole matrix costs 2(N-1) test durations, linear in N.

Each node runs `nodeside/links.py server`; each test runs `nodeside/links.py client` on the sender
against the receiver's server (see that script for what is measured and how).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Callable, Sequence

from vpscluster import nodeside
from vpscluster.nodeside.links import MAX_WARMUP_S


def round_robin(names: Sequence[str]) -> list[list[tuple[str, str]]]:
    """Steps of disjoint (src, dst) pairs covering every ordered pair exactly once."""
    names = list(names)
    if len(names) < 2:
        return []
    ring: list[str | None] = names + ([None] if len(names) % 2 else [])
    n = len(ring)
    steps: list[list[tuple[str, str]]] = []
    for _ in range(n - 1):
        pairs = [(ring[i], ring[n - 1 - i]) for i in range(n // 2)]
        pairs = [(a, b) for a, b in pairs if a is not None and b is not None]
        steps.append([(a, b) for a, b in pairs])
        steps.append([(b, a) for a, b in pairs])
        ring = [ring[0], ring[-1], *ring[1:-1]]  # rotate all but the first
    return steps


@dataclass(frozen=True)
class LinkSettings:
    duration_s: float = 2.0
    warmup_s: float = 0.5
    streams: int = 1
    rtt_samples: int = 20
    server_start_timeout_s: float = 30.0
    connect_timeout_s: float = 5.0


class _Server:
    def __init__(self):
        self.port: int | None = None
        self.ready = asyncio.Event()
        self.lines: list[str] = []

    def on_line(self, stream: str, line: str) -> None:
        self.lines.append(line)
        if line.startswith("LISTENING "):
            self.port = int(line.split()[1])
            self.ready.set()


async def measure_links(
    nodes: Sequence, executors: dict, settings: LinkSettings,
    on_step: Callable[[int, int], None] | None = None,
) -> list[dict]:
    """Link records for every ordered pair of `nodes` (Node objects, all reachable)."""
    if len(nodes) < 2:
        return []
    by_name = {n.name: n for n in nodes}
    servers = {n.name: _Server() for n in nodes}
    handles = {}
    steps = round_robin([n.name for n in nodes])
    # Idle long enough to outlive the slowest step, short enough to never linger.
    idle_s = max(60.0, 3 * (settings.duration_s + max(settings.warmup_s, MAX_WARMUP_S) + 20))
    try:
        for n in nodes:
            # The address its peers connect to, not every interface (the server is unauthenticated);
            # the server falls back to all of them where that address is not its own (1:1 NAT).
            bind = _address(n.host)
            try:
                handles[n.name] = await executors[n.name].start(
                    nodeside.command(n.python, "links", "server", "--bind", bind, "--idle-timeout-s", str(idle_s)),
                    on_line=servers[n.name].on_line)
            except Exception as e:  # the node went away since its facts: its links report it
                servers[n.name].lines.append(f"{type(e).__name__}: {e}")
        await asyncio.gather(*(_wait_ready(s, settings.server_start_timeout_s) for s in servers.values()))
        links: list[dict] = []
        for i, step in enumerate(steps):
            links += await asyncio.gather(*(
                _measure_pair(by_name[a], by_name[b], servers[b], executors[a], settings) for a, b in step))
            if on_step:
                on_step(i + 1, len(steps))
        return links
    finally:
        await asyncio.gather(*(h.stop(grace_s=2.0) for h in handles.values()), return_exceptions=True)


def _address(host: str) -> str:
    """`host` as an IP address (resolved here once); the wildcard when it does not resolve."""
    from vpscluster.cluster.netsafety import resolve

    found = resolve(host)
    v4 = [a for a in found if ":" not in a]
    return (v4 or found)[0] if found else ("::" if ":" in host else "0.0.0.0")


async def _wait_ready(server: _Server, timeout_s: float) -> None:
    try:
        await asyncio.wait_for(server.ready.wait(), timeout_s)
    except asyncio.TimeoutError:
        pass  # the pairs towards it report the error


async def _measure_pair(src, dst, server: _Server, ex, s: LinkSettings) -> dict:
    record = {"src": src.name, "dst": dst.name, "bandwidth_mbit": None, "rtt_ms": None}
    if server.port is None:
        tail = server.lines[-1] if server.lines else "no output"
        record["error"] = f"measurement server did not start on {dst.name} ({tail})"
        return record
    peer = f"[{dst.host}]:{server.port}" if ":" in dst.host else f"{dst.host}:{server.port}"
    cmd = nodeside.command(src.python, "links", "client", "--peer", peer,
                         "--rtt-samples", str(s.rtt_samples), "--duration-s", str(s.duration_s),
                         "--warmup-s", str(s.warmup_s), "--streams", str(s.streams),
                         "--timeout-s", str(s.connect_timeout_s))
    timeout_s = s.duration_s + max(s.warmup_s, MAX_WARMUP_S) + 2 * s.connect_timeout_s + 30
    result = await ex.run(cmd, timeout_s=timeout_s)
    data = nodeside.parse_json_output(result.stdout) if result.stdout else None
    if data is None:
        record["error"] = f"test from {src.name} failed: {result.reason()}"
        return record
    if data.get("error") or data.get("bandwidth_error"):
        record["error"] = f"{src.name} cannot reach {dst.name} at {peer}: {data.get('error') or data.get('bandwidth_error')}"
    record.update({k: v for k, v in data.items() if k not in ("error", "bandwidth_error", "bytes", "seconds")})
    for k in ("bandwidth_mbit", "rtt_ms", "rtt_ms_min", "rtt_ms_p95", "connect_ms"):
        if isinstance(record.get(k), float):
            record[k] = round(record[k], 3)
    return record
