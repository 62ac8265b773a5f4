"""What is wrong with a cluster, from a probe: rules that turn measurements into problems.

Each problem is a plain dict: {"severity": "error"|"warning"|"info", "code", "message", "nodes",
"fix"} — one line each for the message and the fix. Errors that make a launch pointless (a node
that cannot be reached, PyTorch missing, versions differing) are `blocking_problems`.

The TCP-buffer rule follows the bandwidth-delay product argument (Jacobson & Braden, RFC 1323 /
RFC 7323): one TCP stream cannot carry more than window / RTT, so the largest buffer the kernel
will grant must hold at least bandwidth × RTT bytes.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

# Codes that stop `vpscluster train/run` before anything is started (unless --force).
BLOCKING_CODES = frozenset({
    "node_unreachable", "python_unusable", "torch_missing", "version_mismatch", "gloo_missing", "link_failed",
})


_SHARE_SOURCES = {"cgroup": "cgroup quota", "affinity": "affinity", "measured": "measured"}


@dataclass(frozen=True)
class Thresholds:
    rtt_ms: float = 20.0  # links slower than this round trip are flagged
    bandwidth_ratio: float = 0.5  # measured below this share of the advertised rate is "far below"
    asymmetry_ratio: float = 1.5  # a->b vs b->a differing by more than this factor
    disk_read_mb_s: float = 100.0
    memory_bytes: float = 4 * 2**30
    clock_offset_s: float = 1.0


def problem(severity: str, code: str, message: str, nodes, fix: str) -> dict:
    return {"severity": severity, "code": code, "message": message, "nodes": sorted(set(nodes)), "fix": fix}


def blocking_problems(probe: dict) -> list[dict]:
    """The errors that should stop a launch: unreachable nodes, torch missing, versions differing."""
    return [p for p in probe.get("problems", []) if p["severity"] == "error" and p["code"] in BLOCKING_CODES]


def find_problems(probe: dict, thresholds: Thresholds = Thresholds()) -> list[dict]:
    nodes = probe.get("nodes", [])
    out: list[dict] = []
    out += _reachability(nodes)
    up = [n for n in nodes if n.get("reachable")]
    out += _software(up)
    out += _resources(up, thresholds)
    from vpscluster.probe.regions import region_of, region_problems

    out += _links(probe.get("links", []), {n["name"]: n for n in nodes}, thresholds, region_of(probe))
    out += region_problems(probe)
    for c in probe.get("collectives", []):
        if c.get("error"):
            out.append(problem("warning", "collective_failed", f"all-reduce sweep failed: {c['error']}",
                               c.get("nodes", []), "check the node logs above; the sweep needs torch with gloo on every node"))
    order = {"error": 0, "warning": 1, "info": 2}
    return sorted(out, key=lambda p: (order[p["severity"]], p["code"], p["nodes"]))


def _reachability(nodes: list[dict]) -> list[dict]:
    out = []
    for n in nodes:
        if n.get("reachable"):
            continue
        code = "python_unusable" if n.get("python_error") else "node_unreachable"
        fix = (f"install Python 3 on {n['name']} or set `python:` for it in the cluster file"
               if code == "python_unusable" else
               f"check that {n['name']} is up and that SSH reaches {n.get('host')}:{n.get('port', 22)} "
               "(address, key, firewall), or remove it from the cluster file")
        error = n.get("error") or "no answer"
        message = error if error.startswith(f"{n['name']}:") else f"{n['name']}: {error}"
        out.append(problem("error", code, message, [n["name"]], fix))
    return out


def _software(up: list[dict]) -> list[dict]:
    out = []
    missing = [n for n in up if not n.get("torch")]
    with_torch = [n for n in up if n.get("torch")]
    if missing:
        ref = with_torch[0]["torch"] if with_torch else None
        out.append(problem(
            "error", "torch_missing",
            "PyTorch is not importable with the configured python on " + ", ".join(
                f"{n['name']} ({n.get('python_executable') or n.get('python_path')})" for n in missing),
            [n["name"] for n in missing],
            (f"pip install torch=={ref} with that interpreter, " if ref else "install PyTorch with that interpreter, ")
            + "or point `python:` in the cluster file at one that has it"))
    for n in with_torch:
        if not n.get("gloo_available") and not n.get("nccl_available"):
            out.append(problem("error", "gloo_missing", f"{n['name']}: torch.distributed has neither gloo nor NCCL",
                               [n["name"]], "install a standard PyTorch build (the pip wheels include gloo)"))
    for n in up:  # the CUDA build of torch against the node's NVIDIA driver (nodeside facts gpu_check)
        g = n.get("gpu_check") or {}
        if g.get("status") in ("mismatch", "driver error"):
            out.append(problem("error", "cuda_driver_mismatch", f"{n['name']}: {g.get('message')}", [n["name"]],
                               "match the driver and torch's CUDA build (vpscluster provision pins torch; "
                               "upgrade the driver or pick the torch build for its CUDA)"))
        elif g.get("status") == "cpu build":
            out.append(problem("warning", "gpu_unused", f"{n['name']}: {g.get('message')}", [n["name"]],
                               "install a CUDA build of torch on that node"))
    # Versions must match exactly across nodes; Python only to the minor version (a differing
    # patch level is worth knowing but not a reason to stop).
    checks = [("torch", "PyTorch", with_torch, "error"), ("cuda", "CUDA", with_torch, "error"),
              ("nccl", "NCCL", with_torch, "error")]
    for key, label, group, severity in checks:
        out += _mismatch(group, key, label, severity, lambda n, k=key: n.get(k))
    out += _mismatch(up, "python", "Python", "error", lambda n: ".".join(str(n.get("python", "")).split(".")[:2]))
    if not any(p["code"] == "version_mismatch" and "Python" in p["message"] for p in out):
        warn = _mismatch(up, "python", "Python", "warning", lambda n: n.get("python"))
        out += [dict(p, code="python_patch_differs") for p in warn]
    return out


def _mismatch(group, key, label, severity, value_of) -> list[dict]:
    by_value: dict[object, list[str]] = defaultdict(list)
    for n in group:
        by_value[value_of(n)].append(n["name"])
    if len(by_value) <= 1:
        return []
    # The most common value is the reference; ties go to the value the first node has.
    first = value_of(group[0])
    ref = max(by_value, key=lambda v: (len(by_value[v]), v == first))
    odd = [name for v, names in by_value.items() if v != ref for name in names]
    listing = "; ".join(f"{v or 'none'} on {', '.join(names)}" for v, names in by_value.items())
    return [problem(severity, "version_mismatch", f"{label} versions differ across nodes: {listing}", odd,
                    f"install {label} {ref or 'none'} on {', '.join(odd)} so every node runs the same version")]


def _resources(up: list[dict], t: Thresholds) -> list[dict]:
    out = []
    for n in up:
        name = n["name"]
        if n.get("disk_error"):
            out.append(problem("warning", "disk_unusable", f"{name}: {n['disk_error']}", [name],
                               "set `workdir:` for this node to a writable directory"))
        elif n.get("disk_read_mb_s") is not None and n["disk_read_mb_s"] < t.disk_read_mb_s:
            out.append(problem("warning", "slow_disk",
                               f"{name}: work directory reads at {n['disk_read_mb_s']:.0f} MB/s (< {t.disk_read_mb_s:.0f})",
                               [name], "put the workdir on a local SSD/NVMe volume; keep data and checkpoints there"))
        if n.get("memory_bytes") and n["memory_bytes"] < t.memory_bytes:
            out.append(problem("warning", "low_memory",
                               f"{name}: {n['memory_bytes'] / 2**30:.1f} GiB of memory (< {t.memory_bytes / 2**30:.0f} GiB)",
                               [name], "use a smaller model or batch on this node (see `vpscluster plan`), or a larger machine"))
        offset = n.get("clock_offset_s")
        if offset is not None and abs(offset) > t.clock_offset_s:
            out.append(problem("warning", "clock_skew", f"{name}: clock is {offset:+.2f} s off the head node's",
                               [name], "enable time sync on every node (timedatectl set-ntp true, or chrony)"))
    # One line for all CPU-limited nodes: on a cluster of capped VPS it is every node.
    limited = [n for n in up if n.get("cpu_share") is not None and n.get("cpu_count") and n["cpu_share"] < n["cpu_count"]]
    if limited:
        listing = ", ".join(
            f"{n['name']} {n['cpu_share']:g}/{n['cpu_count']} "
            f"({_SHARE_SOURCES.get(n.get('cpu_share_source'), 'cgroup quota or affinity')})" for n in limited)
        out.append(problem("info", "cpu_limited", f"CPU cores available: {listing}", [n["name"] for n in limited],
                           "nothing to do; the planner accounts for it through the measured FLOP/s"))
    return out


def _advertised(a: dict | None, b: dict | None) -> float | None:
    rates = [x.get("advertised_bandwidth_mbit") for x in (a or {}, b or {}) if x.get("advertised_bandwidth_mbit")]
    return min(rates) if rates else None


def _links(links: list[dict], nodes: dict[str, dict], t: Thresholds, regions: dict[str, str] | None = None) -> list[dict]:
    regions = regions or {}
    out = []
    by_pair = {(l["src"], l["dst"]): l for l in links}
    # (node, sysctl key) -> the worst shortfall over its links: {"have", "need", "where"}
    buffers: dict[tuple[str, str], dict] = {}
    for l in links:
        src, dst = l["src"], l["dst"]
        if l.get("error"):
            out.append(problem("error", "link_failed", f"{src} -> {dst}: {l['error']}", [src, dst],
                               f"allow TCP between the nodes (firewall / security group) from {src} to {dst}"))
            continue
        bw, rtt = l.get("bandwidth_mbit"), l.get("rtt_ms")
        adv = _advertised(nodes.get(src), nodes.get(dst))
        # A port's advertised rate promises nothing about the long-distance links between regions.
        across = regions.get(src) is not None and regions.get(src) != regions.get(dst)
        if bw is not None and adv and bw < t.bandwidth_ratio * adv and not across:
            out.append(problem("warning", "bandwidth_below_advertised",
                               f"{src} -> {dst}: {bw:.0f} Mbit/s measured, {adv:.0f} Mbit/s advertised",
                               [src, dst], "ask the provider, try other regions, or plan with the measured rate "
                               "(vpscluster plan uses it) and a communication-light strategy (diloco)"))
        back = by_pair.get((dst, src))
        if bw and back and back.get("bandwidth_mbit") and src < dst:
            hi, lo = max(bw, back["bandwidth_mbit"]), min(bw, back["bandwidth_mbit"])
            if hi > t.asymmetry_ratio * lo:
                out.append(problem("warning", "asymmetric_link",
                                   f"{src} -> {dst} {bw:.0f} Mbit/s but {dst} -> {src} {back['bandwidth_mbit']:.0f} Mbit/s",
                                   [src, dst], "a ring all-reduce runs at the slower direction; check shaping/plan "
                                   "limits on the slower sender"))
        if rtt is not None and rtt > t.rtt_ms and src < dst:
            out.append(problem("warning", "high_rtt", f"{src} <-> {dst}: round trip {rtt:.1f} ms (> {t.rtt_ms:g} ms)",
                               [src, dst], "prefer nodes in nearby regions; use diloco (rare syncs) over ddp on this link"))
        # The fastest the link could go is what the buffers must cover: measured, or advertised if higher.
        rate = max(bw or 0.0, adv or 0.0)
        if rate and rtt:
            bdp = rate * 1e6 / 8 * rtt / 1000
            for who, keys in ((dst, ("rmem_max", "tcp_rmem")), (src, ("wmem_max", "tcp_wmem"))):
                tcp = (nodes.get(who) or {}).get("tcp") or {}
                for key in keys:
                    value = tcp.get(key)
                    size = value[2] if isinstance(value, list) and len(value) == 3 else value
                    worst = buffers.get((who, key))
                    if isinstance(size, (int, float)) and size < bdp and (not worst or bdp > worst["need"]):
                        buffers[(who, key)] = {"have": size, "need": bdp, "where":
                                               f"{src}->{dst} {rate:.0f} Mbit/s x {rtt:.1f} ms = {bdp / 1e6:.2f} MB"}
    for (who, name), b in sorted(buffers.items()):
        need, have = b["need"], b["have"]
        sysctl = {"rmem_max": "net.core.rmem_max", "wmem_max": "net.core.wmem_max",
                  "tcp_rmem": "net.ipv4.tcp_rmem", "tcp_wmem": "net.ipv4.tcp_wmem"}[name]
        target = 1 << max(int(need - 1).bit_length(), 0)
        value = f"'4096 131072 {target}'" if name.startswith("tcp_") else str(target)
        out.append(problem("warning", "tcp_buffer_small",
                           f"{who}: {sysctl} max {have / 1e6:.2f} MB < bandwidth-delay product ({b['where']})",
                           [who], f"sysctl -w {sysctl}={value} on {who} (vpscluster provision can apply it)"))
    return out
