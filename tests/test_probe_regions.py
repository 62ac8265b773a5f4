"""Regions found from a link matrix (or taken from labels.region), on synthetic matrices."""

from __future__ import annotations

import random

from vpscluster.probe.problems import find_problems
from vpscluster.probe.regions import find_regions, measured_regions


def matrix(regions: dict[str, list[str]], inside: dict[str, float], between: float, noise: float = 0.0,
           seed: int = 0) -> list[dict]:
    """Every ordered pair: `inside[region]` within a region, `between` across; ±noise relative."""
    rng = random.Random(seed)
    where = {n: r for r, nodes in regions.items() for n in nodes}
    names = [n for nodes in regions.values() for n in nodes]
    links = []
    for a in names:
        for b in names:
            if a != b:
                rate = inside[where[a]] if where[a] == where[b] else between
                links.append({"src": a, "dst": b, "bandwidth_mbit": rate * (1 + rng.uniform(-noise, noise)), "rtt_ms": 0.2})
    return links


NAMES = ["node-1", "node-2", "node-3", "node-4"]


def test_two_regions_of_two():
    links = matrix({"fra": NAMES[:2], "lax": NAMES[2:]}, {"fra": 190, "lax": 190}, 29)
    result = find_regions(NAMES, links)
    assert result["regions_from"] == "measured"
    assert [r["nodes"] for r in result["regions"]] == [NAMES[:2], NAMES[2:]]
    assert [r["name"] for r in result["regions"]] == ["region-1", "region-2"]
    assert result["regions"][0]["inside_mbit"] == 190 and result["regions"][0]["between_mbit"] == 29


def test_one_region_when_links_are_alike_with_noise():
    for seed in range(20):
        links = matrix({"x": NAMES}, {"x": 100}, 0, noise=0.3, seed=seed)
        regions = measured_regions(NAMES, links)
        assert regions == [NAMES], (seed, regions)
        result = find_regions(NAMES, links)
        assert len(result["regions"]) == 1 and result["regions"][0]["between_mbit"] is None


def test_noisy_regions_interleaved_and_uneven():
    names = [f"n{i}" for i in range(7)]
    fra, lax, syd = ["n0", "n3", "n5"], ["n1", "n4"], ["n2", "n6"]
    for seed in range(20):
        links = matrix({"fra": fra, "lax": lax, "syd": syd}, {"fra": 1000, "lax": 200, "syd": 400}, 25, noise=0.25,
                       seed=seed)
        assert measured_regions(names, links) == [fra, lax, syd], seed


def test_asymmetric_and_failed_links():
    links = matrix({"a": NAMES[:2], "b": NAMES[2:]}, {"a": 500, "b": 500}, 40)
    for l in links:
        if (l["src"], l["dst"]) == ("node-1", "node-3"):
            l["bandwidth_mbit"] = 480.0  # one fast direction; the pair is as slow as its other one
        if (l["src"], l["dst"]) == ("node-2", "node-4"):
            l["bandwidth_mbit"], l["error"] = None, "connection refused"
    assert measured_regions(NAMES, links) == [NAMES[:2], NAMES[2:]]


def test_single_node_and_lone_far_node():
    assert measured_regions(["only"], []) == [["only"]]
    links = matrix({"a": NAMES[:3], "far": NAMES[3:]}, {"a": 900, "far": 900}, 20)
    assert measured_regions(NAMES, links) == [NAMES[:3], NAMES[3:]]


def test_deterministic_on_ties():
    links = matrix({"x": NAMES}, {"x": 100}, 0)
    assert all(measured_regions(NAMES, links) == [NAMES] for _ in range(3))
    assert measured_regions(list(reversed(NAMES)), links) == [list(reversed(NAMES))]


def _probe(links, labels):
    from vpscluster.probe.regions import find_regions

    names = sorted({l["src"] for l in links})
    r = find_regions(names, links, labels)
    nodes = [{"name": n, "reachable": True, "advertised_bandwidth_mbit": 200.0} for n in names]
    return {"nodes": nodes, "links": links, "regions": r["regions"], "regions_from": r["regions_from"],
            "regions_measured": r["measured"], "regions_labelled": r["labelled"]}


def test_labels_win_and_a_mismatch_is_a_problem():
    links = matrix({"fra": NAMES[:2], "lax": NAMES[2:]}, {"fra": 190, "lax": 190}, 29)
    good = _probe(links, {"node-1": "fra", "node-2": "fra", "node-3": "lax", "node-4": "lax"})
    assert good["regions_from"] == "labels" and [r["name"] for r in good["regions"]] == ["fra", "lax"]
    codes = [p["code"] for p in find_problems(good)]
    # Between regions, 29 Mbit/s against ports advertised at 200 is what regions are: no warning.
    assert "region_mismatch" not in codes and "bandwidth_below_advertised" not in codes

    wrong = _probe(links, {"node-1": "fra", "node-2": "lax", "node-3": "fra", "node-4": "lax"})
    assert [r["nodes"] for r in wrong["regions"]] == [["node-1", "node-3"], ["node-2", "node-4"]]
    mismatch = [p for p in find_problems(wrong) if p["code"] == "region_mismatch"]
    assert len(mismatch) == 1 and "node-1, node-2; node-3, node-4" in mismatch[0]["message"]


def test_partial_labels_fall_back_to_measurement():
    links = matrix({"fra": NAMES[:2], "lax": NAMES[2:]}, {"fra": 190, "lax": 190}, 29)
    probe = _probe(links, {"node-1": "fra"})
    assert probe["regions_from"] == "measured" and len(probe["regions"]) == 2
    missing = [p for p in find_problems(probe) if p["code"] == "region_label_missing"]
    assert len(missing) == 1 and missing[0]["nodes"] == ["node-2", "node-3", "node-4"]


def test_slow_links_inside_one_region_are_still_flagged():
    links = matrix({"x": NAMES}, {"x": 60}, 0)
    codes = [p["code"] for p in find_problems(_probe(links, None))]
    assert "bandwidth_below_advertised" in codes


def test_rich_output_has_a_regions_line():
    from vpscluster.probe.report import regions_line

    links = matrix({"fra": NAMES[:2], "lax": NAMES[2:]}, {"fra": 190, "lax": 180}, 29)
    probe = _probe(links, {"node-1": "fra", "node-2": "fra", "node-3": "lax", "node-4": "lax"})
    assert regions_line(probe) == ("regions (from labels.region): fra node-1,node-2 190 Mbit/s inside, 29 between; "
                                   "lax node-3,node-4 180 Mbit/s inside, 29 between")
