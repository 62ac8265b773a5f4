"""The plan of the hierarchical strategy: its cost on regions, where its regions come from, and
`auto`/`plan` weighing it against flat DiLoCo (pure arithmetic, no processes)."""

from __future__ import annotations

import dataclasses

import pytest

from test_plan_auto import probe_doc

from vpscluster.cluster.node import Cluster, Node
from vpscluster.config import build
from vpscluster.plan import auto, hierarchical
from vpscluster.plan.predict import Settings, predict
from vpscluster.plan.resources import LinkMatrix, NodeResources, Resources
from vpscluster.plan.shapes import load_model
from vpscluster.train.config import LauncherChoices, TrainConfig
from vpscluster.train.strategies.hierarchical_costs import FEWER_REPLICAS

REGIONS = {"n0": "fra", "n1": "fra", "n2": "lax", "n3": "lax"}
TOKENS = 2e8


@pytest.fixture(autouse=True)
def _no_calibration_cache(tmp_path, monkeypatch):
    monkeypatch.setattr("vpscluster.plan.calibrate._cache_path", lambda: tmp_path / "calibration.json")


def two_regions(inside_mbit=1000.0, between_mbit=30.0):
    names = list(REGIONS)
    bw = [[inside_mbit if REGIONS[a] == REGIONS[b] else between_mbit for b in names] for a in names]
    rtt = [[1.0 if REGIONS[a] == REGIONS[b] else 150.0 for b in names] for a in names]
    return Resources([NodeResources(n, 40e9, 8e9) for n in names], LinkMatrix(names, bw, rtt))


def slow_between(inside_mbit=1000.0, between_mbit=30.0):
    return probe_doc(bandwidth_mbit=inside_mbit, rtt_ms=1.0,
                     slow={(a, b): between_mbit for a in REGIONS for b in REGIONS if REGIONS[a] != REGIONS[b]})


def cluster(labels=True):
    nodes = tuple(Node(name=n, host=f"10.0.0.{i + 1}", labels={"region": r} if labels else {})
                  for i, (n, r) in enumerate(REGIONS.items()))
    return Cluster(nodes=nodes, head="n0", source="test-cluster.yaml")


def test_cost_is_ddp_inside_each_region_plus_the_leaders_sync_spread_over_h():
    model, res = load_model("small"), two_regions()
    h = Settings(name="hierarchical", sync_every=50, wire_dtype="int8", launcher=LauncherChoices(node_regions=REGIONS))
    p = predict(model, res, h, TOKENS, 0.5)
    inside = predict(model, hierarchical._subset(res, [0, 1]), Settings(name="ddp"), TOKENS, 0.5)
    flat = predict(model, res, dataclasses.replace(h, name="diloco", overlap_steps=0), TOKENS, 0.5)
    assert inside.comm_seconds > 0  # the per-step all-reduce inside a region costs something
    assert p.step_seconds > inside.step_seconds  # ... and the sync across regions adds to it
    # The leaders' ring of 2 over the 30 Mbit/s link syncs faster than flat DiLoCo's ring of 4
    # that crosses it (2(n-1)/n of the buffer per rank: 1 against 1.5).
    assert p.step_seconds - inside.step_seconds < flat.comm_seconds
    # Longer rounds: the sync's share shrinks towards DDP inside the regions.
    longer = predict(model, res, dataclasses.replace(h, sync_every=500), TOKENS, 0.5)
    assert inside.step_seconds < longer.step_seconds < p.step_seconds
    assert p.quality_risk == flat.quality_risk - FEWER_REPLICAS  # 2 replicas, not 4
    assert p.settings.label() == "hierarchical H=50 int8"
    # One region: ddp, the same prediction.
    one = predict(model, res, h.with_launcher(node_regions=dict.fromkeys(REGIONS, "fra")), TOKENS, 0.5)
    ddp = predict(model, res, Settings(name="ddp"), TOKENS, 0.5)
    assert one.step_seconds == ddp.step_seconds and one.bytes_sent_per_step == ddp.bytes_sent_per_step


def test_regions_come_from_labels_else_from_the_probe():
    assert hierarchical.cluster_regions(cluster(), None) == REGIONS
    probe = {"regions": [{"name": "region-1", "nodes": ["n0", "n1"]}, {"name": "region-2", "nodes": ["n2", "n3"]}]}
    found = hierarchical.cluster_regions(cluster(labels=False), probe)
    assert found == {"n0": "region-1", "n1": "region-1", "n2": "region-2", "n3": "region-2"}
    assert hierarchical.cluster_regions(cluster(labels=False), None) is None  # nothing says
    assert hierarchical.cluster_regions(cluster(labels=False), {"regions": [probe["regions"][0]]}) is None


def _cfg(name):
    return build(TrainConfig, {"preset": "small", "strategy": {"name": name}, "max_steps": 2000,
                               "checkpoint_every": 100, "cluster": "c.yaml"})


def test_auto_weighs_hierarchical_where_regions_exist_and_takes_it_when_links_inside_are_fast():
    cfg = _cfg("auto")
    strategy, reason = auto.choose_for_training(cfg, cluster(), slow_between(inside_mbit=10000.0), given=set())
    assert strategy.name == "hierarchical" and strategy.launcher.node_regions == REGIONS
    assert reason.startswith("hierarchical H=") and "2 regions" in reason
    assert strategy.overlap_steps == 0 and 100 % strategy.sync_every == 0
    cfg.strategy = strategy
    cfg.validate()
    # No regions (no labels, uniform links in the probe): flat DiLoCo, as before.
    flat, _ = auto.choose_for_training(_cfg("auto"), cluster(labels=False), probe_doc(bandwidth_mbit=20.0), given=set())
    assert flat.name == "diloco"


def test_train_hierarchical_plans_h_on_the_leaders_and_refuses_without_regions():
    from vpscluster.errors import UserError

    cfg = _cfg("hierarchical")
    model, res, eff = auto.plan_inputs(cfg, cluster(), slow_between())
    s = hierarchical.plan_settings(cfg, model, res, eff.value, REGIONS, given=set())
    assert s.name == "hierarchical" and "sync_every" in s.launcher.planned and s.launcher.replan is None
    assert 100 % s.sync_every == 0 and s.launcher.node_regions == REGIONS
    kept = hierarchical.plan_settings(cfg, model, res, eff.value, REGIONS, given={"sync_every"})
    assert kept.sync_every == cfg.strategy.sync_every
    with pytest.raises(UserError, match="two regions"):
        hierarchical.plan_for_training(cfg, None)
