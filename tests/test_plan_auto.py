"""Strategy choice, egress quotas, probe handling and predictions built from a probe."""

from __future__ import annotations

import pytest

from vpscluster.cluster.node import Cluster, Node
from vpscluster.plan import auto
from vpscluster.plan.api import PlanRequest, make_plan
from vpscluster.plan.predict import Settings, predict
from vpscluster.plan.resources import gather_resources
from vpscluster.plan.shapes import load_model


@pytest.fixture(autouse=True)
def _no_calibration_cache(tmp_path, monkeypatch):
    # A calibration cached by an earlier `plan --calibrate` must not change these results.
    monkeypatch.setattr("vpscluster.plan.calibrate._cache_path", lambda: tmp_path / "calibration.json")


def probe_doc(n=4, bandwidth_mbit=100.0, rtt_ms=1.0, flops=20e9, memory_bytes=8e9, slow=None):
    names = [f"n{i}" for i in range(n)]
    flops = flops if isinstance(flops, list) else [flops] * n
    nodes = [{"name": name, "cpu_count": 2, "memory_bytes": memory_bytes, "gpus": [], "disk_read_mb_s": 500.0,
              "flops": f, "flops_device": "cpu", "torch_threads": 2} for name, f in zip(names, flops)]
    links = [{"src": a, "dst": b, "bandwidth_mbit": (slow or {}).get((a, b), bandwidth_mbit), "rtt_ms": rtt_ms}
             for a in names for b in names if a != b]
    return {"nodes": nodes, "links": links, "collectives": [], "problems": []}


def cluster_of(n=4, quota=None):
    nodes = tuple(Node(name=f"n{i}", host=f"10.0.0.{i + 1}", egress_quota_bytes=quota[0] if quota else None,
                       egress_quota_period_s=quota[1] if quota else None) for i in range(n))
    return Cluster(nodes=nodes, head="n0", source="test-cluster.yaml")


def test_auto_picks_ddp_on_fast_links_and_diloco_on_slow_links_for_the_same_model():
    model = load_model("small")
    fast = gather_resources(cluster_of(), probe_doc(bandwidth_mbit=10000.0))
    slow = gather_resources(cluster_of(), probe_doc(bandwidth_mbit=20.0))
    chosen_fast, reason_fast, _ = auto.choose(model, fast, 1e8, 0.5)
    chosen_slow, reason_slow, _ = auto.choose(model, slow, 1e8, 0.5)
    assert chosen_fast.settings.name == "ddp" and chosen_fast.settings.compress == "none"
    assert chosen_slow.settings.name == "diloco"
    assert reason_fast.startswith("ddp:") and "%" in reason_fast
    assert reason_slow.startswith("diloco") and "faster" in reason_slow
    assert "\n" not in reason_fast + reason_slow
    # The choice is the low-risk one among those nearly as fast as the fastest.
    assert chosen_slow.quality_risk <= auto.MAX_RISK


def test_one_node_needs_no_synchronisation():
    model = load_model("tiny")
    res = gather_resources(None, probe_doc(n=1))
    chosen, reason, _ = auto.choose(model, res, 1e6, 0.5)
    assert chosen.settings.name == "ddp" and chosen.comm_seconds == 0 and chosen.bytes_sent_per_step == 0
    assert "one rank" in reason


def test_prediction_from_probe_figures_by_hand():
    model = load_model("small")
    res = gather_resources(cluster_of(2), probe_doc(n=2, flops=[20e9, 10e9], bandwidth_mbit=100.0))
    pred = predict(model, res, Settings("diloco", sync_every=10), 1e6, 0.5)
    tokens = model.shape.batch_size * model.shape.seq_len
    slow_compute = model.flops_per_token() * tokens / (10e9 * 0.5)
    fast_compute = slow_compute / 2
    assert pred.compute_seconds == pytest.approx(slow_compute)  # the slowest node sets the pace
    assert pred.nodes[0].wait_seconds == pytest.approx(slow_compute - fast_compute)
    assert pred.step_seconds == pytest.approx(slow_compute + pred.comm_seconds)
    assert pred.compute_utilization == pytest.approx((slow_compute + fast_compute) / 2 / pred.step_seconds)
    assert pred.tokens_per_s == pytest.approx(2 * tokens / pred.step_seconds)
    assert pred.steps == -(-int(1e6) // (2 * tokens))


def test_egress_quota_that_the_run_would_exceed_is_flagged():
    model = load_model("small")
    probe = probe_doc(bandwidth_mbit=100.0)
    tight = gather_resources(cluster_of(quota=(1e12, 30 * 86400)), probe)  # 1 TB/month
    ddp = predict(model, tight, Settings("ddp"), 5e9, 0.5)
    assert ddp.quota_exceeded and len(ddp.quota_exceeded) == 4
    node = ddp.nodes[0]
    rate = node.bytes_sent_per_step / ddp.step_seconds
    assert node.egress_exceeded_after_s == pytest.approx(1e12 / rate)
    assert node.egress_bytes_per_day == pytest.approx(rate * 86400)
    # DiLoCo with H=100 sends ~100x less: the same quota holds.
    assert not predict(model, tight, Settings("diloco", sync_every=100), 5e9, 0.5).quota_exceeded
    # A short run stays within even a tight quota.
    assert not predict(model, tight, Settings("ddp"), 1e6, 0.5).quota_exceeded


def test_plan_document_flags_the_quota_in_words(tmp_path):
    (tmp_path / "cluster.yaml").write_text(
        "nodes:\n" + "".join(f"  - {{name: n{i}, host: 10.0.0.{i + 1}, egress_quota: 1TB/month}}\n" for i in range(4)))
    import json

    (tmp_path / "probe.json").write_text(json.dumps(probe_doc(bandwidth_mbit=100.0)))
    doc = make_plan(PlanRequest(model="small", tokens=5e9, cluster=str(tmp_path / "cluster.yaml"),
                                probe=str(tmp_path / "probe.json"), strategy="ddp"))
    assert doc["egress"]["quota_exceeded"]
    assert "quota" in doc["egress"]["warnings"][0] and "n0" in doc["egress"]["warnings"][0]


def test_plan_without_probe_states_its_assumptions():
    doc = make_plan(PlanRequest(model="small", nodes=2))
    text = " | ".join(doc["assumptions"])
    assert "not by the probe" in text  # FLOP/s measured here, not by the probe
    assert "Mbit/s" in text and "not measured" in text  # links
    assert "tokens" in text and "matmul" in text
    assert doc["measured"] is False
    # Every contract key is present and numeric where it should be.
    for key in ("step_seconds", "compute_seconds", "comm_seconds", "tokens_per_s", "compute_utilization",
                "memory_bytes_per_node", "time_to_train_seconds", "egress_bytes_per_node_per_day"):
        assert isinstance(doc[key], (int, float)) and doc[key] >= 0, key


def test_plan_from_a_full_probe_assumes_no_hardware_figures(tmp_path):
    import json

    (tmp_path / "probe.json").write_text(json.dumps(probe_doc()))
    doc = make_plan(PlanRequest(model="small", tokens=1e8, probe=str(tmp_path / "probe.json")))
    assert doc["measured"] is True
    assert not [a for a in doc["assumptions"] if "bandwidth" in a or "GFLOP/s" in a or "memory" in a]
    assert any("--calibrate" in a for a in doc["assumptions"])  # only the efficiency is assumed
    assert [n["name"] for n in doc["nodes"]] == ["n0", "n1", "n2", "n3"]


def test_probe_missing_links_falls_back_to_advertised_bandwidth():
    probe = probe_doc(n=2)
    probe["links"] = []
    nodes = tuple(Node(name=f"n{i}", host=f"10.0.0.{i}", advertised_bandwidth_mbit=[300.0, 200.0][i]) for i in range(2))
    res = gather_resources(Cluster(nodes=nodes, head="n0", source="c.yaml"), probe)
    assert res.links.bandwidth_mbit[0][1] == 200.0
    assert any("advertised_bandwidth" in a for a in res.assumptions)


def test_choose_for_training_returns_a_valid_strategy_config():
    from vpscluster.config import build
    from vpscluster.train.config import TrainConfig

    cfg = build(TrainConfig, {"preset": "small", "strategy": {"name": "auto"}, "max_steps": 2000,
                              "checkpoint_every": 100, "cluster": "c.yaml"})
    slow = probe_doc(bandwidth_mbit=20.0)
    strategy, reason = auto.choose_for_training(cfg, cluster_of(), slow)
    assert strategy.name == "diloco" and 100 % strategy.sync_every == 0
    strategy.validate()
    cfg.strategy = strategy
    cfg.validate()  # checkpoint_every stays a multiple of sync_every
    assert reason
    fast_strategy, _ = auto.choose_for_training(cfg, cluster_of(), probe_doc(bandwidth_mbit=10000.0))
    assert fast_strategy.name == "ddp"


def test_choose_for_training_on_the_local_cluster_without_probe_picks_ddp():
    from vpscluster.config import build
    from vpscluster.train.config import TrainConfig

    cfg = build(TrainConfig, {"preset": "tiny", "strategy": {"name": "auto"}, "nodes": 2})
    strategy, reason = auto.choose_for_training(cfg, None, None)
    assert strategy.name == "ddp" and "communication" in reason


def test_gpu_nodes_plan_gpu_memory_and_precision_as_asked(tmp_path):
    import json

    probe = probe_doc(n=2)
    for node in probe["nodes"]:
        node.update(gpus=[{"name": "H100", "memory_bytes": 80e9}], flops_device="cuda", flops=400e12)
    (tmp_path / "probe.json").write_text(json.dumps(probe))
    p = load_model("1.3b").num_params()
    fp32 = make_plan(PlanRequest(model="1.3b", tokens=1e9, probe=str(tmp_path / "probe.json"), strategy="ddp"))
    mixed = make_plan(PlanRequest(model="1.3b", tokens=1e9, probe=str(tmp_path / "probe.json"), strategy="ddp",
                                  mixed_precision=True))
    assert fp32["nodes"][0]["memory_kind"] == "gpu" and fp32["nodes"][0]["memory_available_bytes"] == 80e9
    assert fp32["memory"]["components"]["weights"] == 4 * p  # vpscluster trains in fp32
    assert mixed["memory"]["components"]["weights"] == 2 * p and mixed["memory"]["components"]["optimizer"] == 12 * p
    assert mixed["memory_bytes_per_node"] < fp32["memory_bytes_per_node"]


# -- DiLoCo's H, wire and outer optimizer from the plan (train/strategies/sync_rule.py) ---------------------


def _diloco_cfg(**strategy):
    from vpscluster.config import build
    from vpscluster.train.config import TrainConfig

    return build(TrainConfig, {"preset": "small", "strategy": {"name": "diloco", **strategy}, "max_steps": 2000,
                               "checkpoint_every": 100, "cluster": "c.yaml"})


def test_plan_diloco_fills_in_every_key_the_user_left_open():
    from vpscluster.train.strategies import sync_rule

    cfg = _diloco_cfg()
    slow = auto.plan_diloco(cfg, *_inputs(cfg, 20.0), given=set())
    fast = auto.plan_diloco(cfg, *_inputs(cfg, 10000.0), given=set())
    assert slow.wire_dtype == "int8" and fast.wire_dtype == "fp32"
    assert fast.sync_every == sync_rule.H_MIN <= slow.sync_every and 100 % slow.sync_every == 0
    assert slow.launcher.planned == sorted(sync_rule.KEYS) and slow.launcher.planned_reason.startswith(f"H={slow.sync_every} int8")
    assert (slow.outer_lr, slow.outer_momentum) == (sync_rule.outer_lr_for(slow.sync_every), 0.9)
    assert (fast.outer_lr, fast.outer_momentum) == (0.5, 0.9)  # H = 10
    assert slow.outer_warmup == sync_rule.outer_warmup_for(slow.sync_every) >= 1
    cfg.strategy = slow
    cfg.validate()  # checkpoints still fall on outer steps


def test_what_the_user_set_wins_over_the_plan():
    cfg = _diloco_cfg(sync_every=50, wire_dtype="fp32", outer_lr=0.5)
    s = auto.plan_diloco(cfg, *_inputs(cfg, 100.0), given={"sync_every", "wire_dtype", "outer_lr"})
    assert (s.sync_every, s.wire_dtype, s.outer_lr) == (50, "fp32", 0.5)
    assert s.launcher.planned == ["outer_momentum", "outer_warmup"] and s.outer_warmup == 2
    assert "as set: outer_lr, sync_every, wire_dtype" in s.launcher.planned_reason
    # A StrategyConfig built in Python carries no record: values off the defaults count as set.
    assert auto.given_keys(cfg.strategy) == {"sync_every", "outer_lr"}
    everything = auto.plan_diloco(cfg, *_inputs(cfg, 100.0), given={"sync_every", "wire_dtype", "outer_lr",
                                                                     "outer_momentum", "outer_warmup"})
    assert everything.launcher.planned == [] and everything.outer_warmup == 0


def test_auto_choosing_diloco_uses_the_sync_rule():
    from vpscluster.config import build
    from vpscluster.train.config import TrainConfig

    cfg = build(TrainConfig, {"preset": "small", "strategy": {"name": "auto"}, "max_steps": 2000,
                              "checkpoint_every": 100, "cluster": "c.yaml"})
    strategy, reason = auto.choose_for_training(cfg, cluster_of(), probe_doc(bandwidth_mbit=20.0), given=set())
    expected = auto.plan_diloco(cfg, *_inputs(cfg, 20.0), given=set())
    assert strategy.name == "diloco" and strategy.fragments == 1
    assert (strategy.sync_every, strategy.wire_dtype, strategy.outer_warmup) == (
        expected.sync_every, expected.wire_dtype, expected.outer_warmup)
    assert reason.startswith(f"diloco H={strategy.sync_every} {strategy.wire_dtype}") and expected.launcher.planned_reason in reason
    assert strategy.launcher.planned_reason == reason


def test_an_egress_quota_in_the_cluster_file_bounds_the_plan():
    from vpscluster.config import build
    from vpscluster.train.strategies import sync_rule
    from vpscluster.plan.compute import tokens_per_rank_step
    from vpscluster.train.config import TrainConfig

    month = 30 * 86400
    cfg = _diloco_cfg()  # 2,000 steps: far shorter than the month, so the run may send the whole quota
    model = load_model("small")
    int8_every_step = sync_rule.sync_bytes(model.num_params(), 4, "int8") * cfg.max_steps  # per rank
    quota = int8_every_step / 50 * 1.02  # room for H = 50 int8 over the run, not for H = 25
    free = auto.plan_diloco(cfg, *_inputs(cfg, 1000.0), given=set())
    model, res, eff = auto.plan_inputs(cfg, cluster_of(quota=(quota, month)), probe_doc(bandwidth_mbit=1000.0))
    capped = auto.plan_diloco(cfg, model, res, eff.value, given=set())
    assert (free.sync_every, free.wire_dtype) == (10, "fp32")
    assert (capped.sync_every, capped.wire_dtype) == (50, "int8") and "egress quota allows" in capped.launcher.planned_reason
    assert capped.outer_lr == sync_rule.outer_lr_for(50)
    # `plan`'s own check agrees: over the run, H = 50 int8 keeps the quota and H = 25 does not.
    tokens = cfg.max_steps * tokens_per_rank_step(model) * 4
    assert not predict(model, res, Settings("diloco", sync_every=50, wire_dtype="int8"), tokens, eff.value).quota_exceeded
    assert predict(model, res, Settings("diloco", sync_every=25, wire_dtype="int8"), tokens, eff.value).quota_exceeded
    # The ranks re-plan within the same quota (train/replan.py).
    r = capped.launcher.replan
    assert r.egress_quotas == [[quota, month]] * 4 and r.run_steps == cfg.max_steps
    # auto: plain DDP is faster on 10 Gbit/s links but would use up the quota, so DiLoCo runs.
    auto_cfg = build(TrainConfig, {"preset": "small", "strategy": {"name": "auto"}, "max_steps": 2000,
                                   "checkpoint_every": 100, "cluster": "c.yaml"})
    fast = probe_doc(bandwidth_mbit=10000.0)
    assert auto.choose_for_training(auto_cfg, cluster_of(), fast, given=set())[0].name == "ddp"
    strategy, reason = auto.choose_for_training(auto_cfg, cluster_of(quota=(quota, month)), fast, given=set())
    assert (strategy.name, strategy.sync_every, strategy.wire_dtype) == ("diloco", 50, "int8")
    assert reason.startswith("diloco H=50 int8: plain DDP would use up n0's egress quota after")


def _inputs(cfg, mbit):
    model, res, eff = auto.plan_inputs(cfg, cluster_of(), probe_doc(bandwidth_mbit=mbit))
    return model, res, eff.value


def test_a_short_run_gets_an_h_that_divides_its_checkpoints():
    from vpscluster.config import build
    from vpscluster.train.config import TrainConfig

    cfg = build(TrainConfig, {"preset": "small", "strategy": {"name": "diloco"}, "max_steps": 12,
                              "checkpoint_every": 100, "cluster": "c.yaml"})
    s = auto.plan_diloco(cfg, *_inputs(cfg, 20.0), given=set())
    assert s.sync_every == 2  # at least 4 outer steps in 12, and a divisor of 100
    cfg.strategy = s
    cfg.validate()
