"""Per-node link rates with tc's token bucket filter (tbf), in both directions.

A node's egress is shaped on its own eth0 (inside its namespace) and its ingress on the
bridge-side veth (whose egress is traffic towards the node). A transfer A -> B therefore passes
two buckets and runs at min(rate A, rate B), as between two VPS with different port speeds.

Tuning (measured with iperf3 on this kind of machine, 10 Mbit/s to 1 Gbit/s): the bucket must
hold at least one timer tick of traffic plus a GSO super-packet, else TCP never fills the link;
2 ms of traffic with a 32 KiB floor does. The queue holds 50 ms of traffic (floor 100 KiB), about
a WAN router's buffer. TCP then reaches ~95.6% of the rate — the payload share of a 1514-byte
frame (1448/1514), i.e. the link itself is exact.

Per-destination rates (a link matrix, links.py) use an htb with a class per rate instead of the
egress tbf; see `shape_pairs`.

Latency needs netem (sch_netem); where the kernel lacks it, `netem_available()` says so before
anything is built.
"""

from __future__ import annotations

import os

from vpscluster.cluster.sandbox.system import run_tool
from vpscluster.errors import RemoteError

BURST_SECONDS = 0.002
MIN_BURST_BYTES = 32 * 1024
QUEUE_SECONDS = 0.050
MIN_QUEUE_BYTES = 100 * 1024
HTB_QUANTUM = 60000  # bytes a class sends per turn when classes share the port (about a GSO packet)


def tbf_args(rate_mbit: float) -> list[str]:
    rate_bytes_s = rate_mbit * 1e6 / 8
    burst = max(MIN_BURST_BYTES, int(rate_bytes_s * BURST_SECONDS))
    limit = max(MIN_QUEUE_BYTES, int(rate_bytes_s * QUEUE_SECONDS))
    return ["tbf", "rate", f"{int(rate_mbit * 1000)}kbit", "burst", str(burst), "limit", str(limit)]


def _netns_prefix(namespace: str | None) -> list[str]:
    return ["ip", "netns", "exec", namespace] if namespace else []


def shape(device: str, rate_mbit: float, namespace: str | None = None, delay_ms: float | None = None) -> None:
    """Root tbf at `rate_mbit` on `device`; with `delay_ms`, a netem child adds one-way delay."""
    tc = _netns_prefix(namespace) + ["tc"]
    root = tc + ["qdisc", "replace", "dev", device, "root", "handle", "1:"] + tbf_args(rate_mbit)
    if run_tool(root, check=False).returncode != 0:  # a root of another kind (the htb of `shape_pairs`)
        run_tool(tc + ["qdisc", "del", "dev", device, "root"], check=False)
        run_tool(root)
    if delay_ms:
        run_tool(tc + ["qdisc", "replace", "dev", device, "parent", "1:1", "handle", "10:",
                       "netem", "delay", f"{delay_ms:g}ms", "limit", "100000"])


def shape_node(namespace: str, veth: str, rate_mbit: float, latency_ms: float | None = None) -> None:
    """Both directions of one node: egress on its eth0, ingress on the bridge-side `veth`.

    `latency_ms` is the round trip added between two nodes, so each direction delays half.
    """
    delay_ms = latency_ms / 2 if latency_ms else None
    shape("eth0", rate_mbit, namespace=namespace, delay_ms=delay_ms)
    shape(veth, rate_mbit, delay_ms=delay_ms)


def shape_pairs(device: str, port_mbit: float, pairs: dict[str, float], namespace: str | None = None) -> None:
    """An htb on `device`: everything at `port_mbit`, traffic to the addresses of `pairs` at their
    rate ({address: Mbit/s}, each at most the port). One class per distinct rate, chosen by a u32
    filter on the destination; the classes' guaranteed rates add up to the port, so the port caps
    their sum, and each may borrow up to its own rate. Each leaf queues as a tbf would (50 ms)."""
    tc = _netns_prefix(namespace) + ["tc"]
    rates = sorted({min(r, port_mbit) for r in pairs.values()})
    share = port_mbit / (len(rates) + 1)  # guaranteed to each leaf; the default one included

    def rate_args(rate: float, ceil: float) -> list[str]:
        burst = max(MIN_BURST_BYTES, int(ceil * 1e6 / 8 * BURST_SECONDS))
        return ["rate", f"{int(rate * 1000)}kbit", "ceil", f"{int(ceil * 1000)}kbit",
                "burst", str(burst), "cburst", str(burst), "quantum", str(HTB_QUANTUM)]

    def leaf(classid: str, handle: str, ceil: float) -> None:
        limit = max(MIN_QUEUE_BYTES, int(ceil * 1e6 / 8 * QUEUE_SECONDS))
        run_tool(tc + ["qdisc", "replace", "dev", device, "parent", classid, "handle", handle, "bfifo", "limit", str(limit)])

    # A fresh root each time (a tbf, or an htb with other classes, may be there).
    run_tool(tc + ["qdisc", "del", "dev", device, "root"], check=False)
    run_tool(tc + ["qdisc", "add", "dev", device, "root", "handle", "1:", "htb", "default", "2"])
    run_tool(tc + ["class", "add", "dev", device, "parent", "1:", "classid", "1:1", "htb"] + rate_args(port_mbit, port_mbit))
    run_tool(tc + ["class", "add", "dev", device, "parent", "1:1", "classid", "1:2", "htb"] + rate_args(share, port_mbit))
    leaf("1:2", "2:", port_mbit)
    for i, rate in enumerate(rates):
        classid = f"1:{10 + i:x}"
        run_tool(tc + ["class", "add", "dev", device, "parent", "1:1", "classid", classid, "htb"]
                 + rate_args(min(share, rate), rate))
        leaf(classid, f"{10 + i:x}:", rate)
        for address, r in sorted(pairs.items()):
            if min(r, port_mbit) == rate:
                run_tool(tc + ["filter", "add", "dev", device, "parent", "1:", "protocol", "ip", "prio", "1",
                               "u32", "match", "ip", "dst", f"{address}/32", "flowid", classid])


def unshape_node(namespace: str, veth: str) -> None:
    """Remove a node's shaping in both directions: its links then run at veth speed (the
    `ideal` row of `bench wan`, a datacenter network). `shape_node` puts it back."""
    for device, ns in (("eth0", namespace), (veth, None)):
        run_tool(_netns_prefix(ns) + ["tc", "qdisc", "del", "dev", device, "root"], check=False)
        left = describe(device, namespace=ns)
        if "tbf" in left or "netem" in left or "htb" in left:
            raise RemoteError(f"could not remove the shaping of {device} ({ns or 'root namespace'}): {left}")


def netem_available() -> bool:
    """Whether this kernel has netem: try it on the loopback of a throw-away namespace."""
    probe = f"vpsc-netem-probe-{os.getpid()}"
    run_tool(["ip", "netns", "add", probe])
    try:
        result = run_tool(["ip", "netns", "exec", probe, "tc", "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms"], check=False)
        return result.returncode == 0
    finally:
        run_tool(["ip", "netns", "delete", probe], check=False)


def describe(device: str, namespace: str | None = None) -> str:
    """`tc qdisc show` for a device, for status and debugging."""
    return run_tool(_netns_prefix(namespace) + ["tc", "qdisc", "show", "dev", device], check=False).stdout.strip()
