"""`run_probe`: the whole probe as named stages — facts, links, collectives, problems, save.

    probe = run_probe(cluster, quick=True)      # dict, the `probe --json` document
    blocking_problems(probe)                    # errors that should stop a launch
    load_probe(cluster, max_age_s=3600)         # the last saved probe, or None

Stages run one after the other (so one test never disturbs another) and each is bounded in
time. A node that cannot be reached is reported, and the rest of the cluster is still probed.
"""

from __future__ import annotations

import asyncio
import datetime
import time
from dataclasses import asdict, dataclass, field
from typing import Callable

from vpscluster.probe.collectives import SweepSettings, run_sweep
from vpscluster.probe.facts import FactsSettings, gather_facts
from vpscluster.probe.links import LinkSettings, measure_links
from vpscluster.probe.problems import Thresholds, blocking_problems, find_problems  # noqa: F401 (re-exported)

# progress(task, completed, total): task is "nodes", "links" or "collectives".
Progress = Callable[[str, int, int], None]

# The keys every node record has, reachable or not (the DESIGN contract).
NODE_KEYS = ("name", "reachable", "cpu_count", "memory_bytes", "gpus", "disk_read_mb_s", "python", "torch", "cuda", "flops")


@dataclass(frozen=True)
class ProbeSettings:
    facts: FactsSettings = field(default_factory=FactsSettings)
    links: LinkSettings = field(default_factory=LinkSettings)
    sweep: SweepSettings | None = field(default_factory=SweepSettings)  # None: no all-reduce sweep
    thresholds: Thresholds = field(default_factory=Thresholds)

    @classmethod
    def make(cls, quick: bool = False, streams: int = 1, thresholds: Thresholds | None = None,
             sweep: bool | None = None) -> "ProbeSettings":
        t = thresholds or Thresholds()
        if quick:
            s = cls(FactsSettings(compute_seconds=0.3, disk_bytes=16 << 20, disk_budget_s=1.0),
                    LinkSettings(duration_s=0.5, warmup_s=0.2, streams=streams, rtt_samples=10), None, t)
        else:
            s = cls(FactsSettings(), LinkSettings(streams=streams), SweepSettings(), t)
        if sweep is True and s.sweep is None:
            s = ProbeSettings(s.facts, s.links, SweepSettings(), t)
        elif sweep is False:
            s = ProbeSettings(s.facts, s.links, None, t)
        return s


def run_probe(cluster, quick: bool = False, *, streams: int = 1, thresholds: Thresholds | None = None,
              sweep: bool | None = None, progress: Progress | None = None, save: bool = True) -> dict:
    """Probe every node and link of `cluster`; returns the probe document (and saves it)."""
    settings = ProbeSettings.make(quick=quick, streams=streams, thresholds=thresholds, sweep=sweep)
    return asyncio.run(run_probe_async(cluster, settings, quick=quick, progress=progress, save=save))


async def run_probe_async(cluster, settings: ProbeSettings, quick: bool = False, progress: Progress | None = None,
                          save: bool = True, executors: dict | None = None) -> dict:
    if executors is None:
        from vpscluster.cluster.inventory import open_executors

        async with open_executors(cluster) as opened:
            return await run_probe_async(cluster, settings, quick, progress, save,
                                         {ex.node.name: ex for ex in opened})
    from vpscluster.probe.store import fingerprint, node_keys, save_probe

    report = progress or (lambda task, done, total: None)
    started = time.time()
    # The head first: it hosts the all-reduce rendezvous and is the reference clock.
    nodes = sorted(cluster.nodes, key=lambda n: n.name != cluster.head)

    done = 0
    report("nodes", 0, len(nodes))

    def on_node(_record):
        nonlocal done
        done += 1
        report("nodes", done, len(nodes))

    from vpscluster.cluster import overlay as overlay_record

    mesh = None if cluster.is_local else overlay_record.load(cluster)
    records = await gather_facts(nodes, executors, settings.facts, on_node,
                                 overlay_interface=mesh.interface if mesh else overlay_record.DEFAULT_INTERFACE)
    facts = {r["name"]: r for r in records}
    up = [n for n in nodes if facts[n.name]["reachable"]]

    steps = 2 * (len(up) - 1 + len(up) % 2) if len(up) > 1 else 0
    if steps:
        report("links", 0, steps)
    links = await measure_links(up, executors, settings.links, lambda i, total: report("links", i, total))
    _clock_offsets(cluster.head, facts, links)
    for link in links:  # what the provider promises for this pair: the slower end's plan
        rates = [facts[x]["advertised_bandwidth_mbit"] for x in (link["src"], link["dst"])
                 if facts[x].get("advertised_bandwidth_mbit")]
        link["advertised_mbit"] = min(rates) if rates else None

    overlay_links: list[dict] = []
    if mesh is not None and len(up) > 1:
        # The same link test between the overlay addresses: what WireGuard costs on these links.
        import dataclasses

        over = [dataclasses.replace(n, host=mesh.addresses[n.name]) for n in up]
        if steps:
            report("overlay links", 0, steps)
        overlay_links = await measure_links(over, executors, settings.links,
                                            lambda i, total: report("overlay links", i, total))

    collectives = []
    with_torch = [n for n in up if facts[n.name].get("torch") and
                  (facts[n.name].get("gloo_available") or facts[n.name].get("nccl_available"))]
    # Without torch everywhere, or with a link that failed, the sweep could only hang until its
    # rendezvous time-out: those problems are reported instead.
    links_ok = not any(l.get("error") for l in links)
    if settings.sweep is not None and len(up) > 1 and len(with_torch) == len(up) and links_ok:
        report("collectives", 0, 1)
        collectives.append(await run_sweep(up, executors, facts, settings.sweep))
        report("collectives", 1, 1)

    probe = {
        "version": 1,
        "probed_at": datetime.datetime.fromtimestamp(started, datetime.timezone.utc).isoformat(timespec="seconds"),
        "probed_at_unix": started,
        "duration_s": None,
        "quick": quick,
        "cluster": {"source": cluster.source, "head": cluster.head, "fingerprint": fingerprint(cluster),
                    "nodes": [n.name for n in cluster.nodes], "node_keys": node_keys(cluster)},
        "settings": {"links": asdict(settings.links), "sweep": asdict(settings.sweep) if settings.sweep else None,
                     "thresholds": asdict(settings.thresholds)},
        "nodes": [_node_record(facts[n.name]) for n in cluster.nodes],
        "links": links,
        "collectives": collectives,
        "provisioning": provisioning_summary(cluster, facts, mesh),
        "overlay_links": overlay_links,
        "overlay_cost": overlay_cost(links, overlay_links) if mesh is not None else None,
    }
    from vpscluster.probe.regions import probe_section

    probe.update(probe_section(probe, cluster))
    probe["problems"] = find_problems(probe, settings.thresholds)
    probe["duration_s"] = round(time.time() - started, 2)
    if save:
        probe["saved_to"] = str(save_probe(cluster, probe))
    return probe


def provisioning_summary(cluster, facts: dict[str, dict], mesh) -> dict:
    """What `vpscluster provision` left, per node (the node records' `provision`) and for the cluster:
    one env hash everywhere and no drift from it, tcp tuned, firewall and overlay up."""
    per = {}
    for n in cluster.nodes:
        f = facts.get(n.name, {})
        p = dict(f.get("provision") or {}) if f.get("reachable") else {}
        if mesh is not None and p:
            p["overlay_expected"] = mesh.addresses.get(n.name)
            p["overlay_up"] = bool(p.get("overlay_up")) and p.get("overlay_address") == p["overlay_expected"]
        per[n.name] = p
    reached = [p for p in per.values() if p]
    hashes = {p.get("env_hash") for p in reached}

    def every(key: str) -> bool | None:
        values = [p.get(key) for p in reached]
        return None if not values or any(v is None for v in values) else all(values)

    return {
        "env_hash": next(iter(hashes)) if len(hashes) == 1 else None,
        "env_hash_match": (len(hashes) == 1 and None not in hashes and not any(p.get("env_drift") for p in reached))
                          if reached else None,
        "tcp_tuned": every("tcp_tuned"), "firewall_up": every("firewall_up"),
        "overlay": mesh.to_dict() if mesh is not None else None,
        "overlay_up": every("overlay_up") if mesh is not None else False,
        "nodes": [{"name": name, **p} for name, p in per.items()],
    }


def overlay_cost(links: list[dict], overlay_links: list[dict]) -> dict:
    """Per ordered pair: bandwidth and RTT through the overlay against the underlay, and the
    medians over the pairs (`bandwidth_ratio` < 1: the overlay is slower)."""
    import statistics

    under = {(l["src"], l["dst"]): l for l in links}
    pairs = []
    for o in overlay_links:
        u = under.get((o["src"], o["dst"]), {})
        ub, ob, ur, orr = u.get("bandwidth_mbit"), o.get("bandwidth_mbit"), u.get("rtt_ms"), o.get("rtt_ms")
        pairs.append({"src": o["src"], "dst": o["dst"], "underlay_mbit": ub, "overlay_mbit": ob,
                      "bandwidth_ratio": round(ob / ub, 3) if ub and ob is not None else None,
                      "underlay_rtt_ms": ur, "overlay_rtt_ms": orr,
                      "rtt_added_ms": round(orr - ur, 3) if ur is not None and orr is not None else None,
                      **({"error": o["error"]} if o.get("error") else {})})
    ratios = [p["bandwidth_ratio"] for p in pairs if p["bandwidth_ratio"] is not None]
    added = [p["rtt_added_ms"] for p in pairs if p["rtt_added_ms"] is not None]
    return {"links": pairs, "bandwidth_ratio": round(statistics.median(ratios), 3) if ratios else None,
            "rtt_added_ms": round(statistics.median(added), 3) if added else None}


def _node_record(facts: dict) -> dict:
    record = {k: facts.get(k) for k in NODE_KEYS}
    record["gpus"] = record["gpus"] or []
    record.update({k: v for k, v in facts.items() if k not in record})
    return record


def _clock_offsets(head: str, facts: dict[str, dict], links: list[dict]) -> None:
    """Each node's clock minus the head's, from the head's ping exchanges (NTP-style midpoint)."""
    if head in facts and facts[head].get("reachable"):
        facts[head]["clock_offset_s"] = 0.0
        facts[head]["clock_uncertainty_s"] = 0.0
    for link in links:
        if link["src"] == head and link.get("clock_offset_s") is not None:
            facts[link["dst"]]["clock_offset_s"] = link["clock_offset_s"]
            facts[link["dst"]]["clock_uncertainty_s"] = link.get("clock_uncertainty_s")
