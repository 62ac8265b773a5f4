"""Regions: groups of nodes joined by fast links, joined to each other by slow ones.

    find_regions(names, links, labels=None) -> {"regions": [...], "regions_from": ..., "measured": [...]}
    region_problems(result, names) -> problems     labels that disagree with the links, or half given

From the link matrix (`measured_regions`): the pair rate of two nodes is the slower direction
of the two measured; pairs are taken fastest first (Kruskal's maximum spanning tree, i.e.
single-linkage clustering), and two groups join unless the pair is more than `factor` times
slower than the slowest link already inside either group. Two lone nodes always join (nothing
to compare with), so one region is found where the links are all alike. Bandwidth alone cannot
tell a node in a far region from a nearby node with a slow port: both become a region of their
own (for syncing, a bandwidth island is what matters). Deterministic: ties are
broken by the nodes' order.

From `labels.region` when every node has one: the labels are the regions, and the measured
grouping is only compared with them (a mismatch is a `region_mismatch` problem).

Each region: {"name", "nodes", "inside_mbit", "between_mbit"}: the medians of the measured rates
of the ordered pairs inside it and from it to other regions (None where there are none).
"""

from __future__ import annotations

import statistics
from typing import Sequence

FACTOR = 3.0  # a link this many times slower than those inside a region is between regions


def pair_rates(links: Sequence[dict]) -> dict[tuple[str, str], float]:
    """{(a, b) with a < b: the slower measured direction}; pairs with an error or no number left out."""
    directed = {(l["src"], l["dst"]): l.get("bandwidth_mbit") for l in links if not l.get("error")}
    out: dict[tuple[str, str], float] = {}
    for (a, b), rate in directed.items():
        if rate is None or rate <= 0:
            continue
        back = directed.get((b, a))
        key = (a, b) if a < b else (b, a)
        value = min(rate, back) if back else rate
        out[key] = min(out.get(key, value), value)
    return out


def measured_regions(names: Sequence[str], links: Sequence[dict], factor: float = FACTOR) -> list[list[str]]:
    """Groups of `names` (in their order; groups ordered by their first node) from the link rates."""
    order = {n: i for i, n in enumerate(names)}
    group = {n: n for n in names}  # union-find parent
    slowest: dict[str, float] = {}  # root -> slowest link joined inside its group (absent: a lone node)

    def root(n: str) -> str:
        while group[n] != n:
            group[n] = group[group[n]]
            n = group[n]
        return n

    rates = pair_rates(links)
    for (a, b), rate in sorted(rates.items(), key=lambda kv: (-kv[1], order.get(kv[0][0], 0), order.get(kv[0][1], 0))):
        if a not in group or b not in group:
            continue
        ra, rb = root(a), root(b)
        if ra == rb:
            continue
        if any(r in slowest and rate * factor < slowest[r] for r in (ra, rb)):
            continue
        group[rb] = ra
        slowest[ra] = min([rate] + [slowest[r] for r in (ra, rb) if r in slowest])
    groups: dict[str, list[str]] = {}
    for n in names:
        groups.setdefault(root(n), []).append(n)
    return sorted(groups.values(), key=lambda g: order[g[0]])


def _median(values: list[float]) -> float | None:
    return round(statistics.median(values), 1) if values else None


def describe(named: list[tuple[str, list[str]]], links: Sequence[dict]) -> list[dict]:
    """The region records: name, nodes, and median measured rates inside and out."""
    where = {n: name for name, nodes in named for n in nodes}
    out = []
    for name, nodes in named:
        inside, between = [], []
        for l in links:
            bw = l.get("bandwidth_mbit")
            if l.get("error") or bw is None or l["src"] not in nodes or l["dst"] not in where:
                continue
            (inside if where[l["dst"]] == name else between).append(bw)
        out.append({"name": name, "nodes": list(nodes), "inside_mbit": _median(inside), "between_mbit": _median(between)})
    return out


def find_regions(names: Sequence[str], links: Sequence[dict], labels: dict[str, str | None] | None = None,
                 factor: float = FACTOR) -> dict:
    """The regions of nodes `names` (the reachable ones): from `labels` ({node: region or None})
    when every node has one, else measured. `measured` is the grouping the links alone give."""
    names = list(names)
    measured = measured_regions(names, links, factor)
    labels = labels or {}
    if names and all(labels.get(n) for n in names):
        named: dict[str, list[str]] = {}
        for n in names:
            named.setdefault(str(labels[n]), []).append(n)
        source = "labels"
        regions = list(named.items())
    else:
        source = "measured"
        regions = [(f"region-{i}", g) for i, g in enumerate(measured, start=1)]
    return {"regions": describe(regions, links), "regions_from": source, "measured": measured,
            "labelled": sorted(n for n in names if labels.get(n))}


def probe_section(probe: dict, cluster) -> dict:
    """The probe document's region keys for `cluster`'s reachable nodes: `regions`,
    `regions_from`, `regions_measured` (the grouping of the links alone), `regions_labelled`."""
    names = [n["name"] for n in probe.get("nodes", []) if n.get("reachable")]
    labels = {n.name: (n.labels or {}).get("region") for n in cluster.nodes}
    result = find_regions(names, probe.get("links") or [], labels)
    return {"regions": result["regions"], "regions_from": result["regions_from"],
            "regions_measured": result["measured"], "regions_labelled": result["labelled"]}


def region_of(probe: dict) -> dict[str, str]:
    """{node: its region's name} from a probe document (empty without regions)."""
    return {n: r["name"] for r in probe.get("regions") or [] for n in r["nodes"]}


def region_problems(probe: dict) -> list[dict]:
    """Labels that disagree with the measured grouping, or that only some nodes have."""
    from vpscluster.probe.problems import problem

    if not probe.get("regions"):
        return []
    names = [n for r in probe["regions"] for n in r["nodes"]]
    result = {"regions": probe["regions"], "regions_from": probe.get("regions_from"),
              "measured": probe.get("regions_measured") or [], "labelled": probe.get("regions_labelled") or []}
    out = []
    if result["regions_from"] == "labels":
        given = sorted(sorted(r["nodes"]) for r in result["regions"])
        found = sorted(sorted(g) for g in result["measured"])
        if given != found:
            said = "; ".join(f"{r['name']}: {', '.join(r['nodes'])}" for r in result["regions"])
            seen = "; ".join(", ".join(g) for g in result["measured"])
            out.append(problem("warning", "region_mismatch",
                               f"labels.region says {said}, but the measured links group {seen}",
                               [n for g in result["measured"] for n in g],
                               "correct labels.region in the cluster file, or check the links between the "
                               "nodes the labels put together (plans take regions from the labels)"))
    partial = [n for n in names if n not in result["labelled"]]
    if result["labelled"] and partial:
        out.append(problem("warning", "region_label_missing",
                           f"labels.region is set on {', '.join(result['labelled'])} but not on {', '.join(partial)}; "
                           "regions are taken from the measured links instead", partial,
                           "give every node a labels.region in the cluster file, or none"))
    return out
