"""Step time measured on the planned model (plan/steptime.py) and predicted vs measured in a run's
report (train/prediction.py): robust summaries, the cache key, the correction, a real 2-rank run."""

from __future__ import annotations

import dataclasses
import json

import pytest

from conftest import run_cli
from vpscluster.cluster.inventory import local_cluster
from vpscluster.plan import steptime
from vpscluster.train import prediction
from vpscluster.train.presets import ModelShape, get_preset


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    # Step times cached by earlier runs on this machine must not leak in (nor ours out).
    monkeypatch.setattr("vpscluster.plan.calibrate._cache_path", lambda: tmp_path / "cache" / "calibration.json")


def test_robust_summary_drops_warmup_and_resists_outliers():
    # Two warm-up steps (allocations), then repeats around 1.0 s with one 9 s spike (another job).
    samples = [6.0, 3.0, 1.00, 1.02, 0.98, 9.0, 1.01, 0.99]
    s = steptime.robust_summary(samples, warmup=2)
    assert s["repeats"] == 6 and s["outliers"] == 1
    assert s["median_s"] == pytest.approx(1.005)
    assert s["spread"] == pytest.approx(0.04 / 1.005)  # the spike is left out of the spread
    assert s["mean_s"] > 2.0  # what a plain mean would have reported
    # Identical repeats: no outlier, no spread; nothing valid after the warm-up: an error.
    same = steptime.robust_summary([0.5] * 4)
    assert same["median_s"] == 0.5 and same["outliers"] == 0 and same["spread"] == 0
    with pytest.raises(ValueError):
        steptime.robust_summary([1.0, 2.0], warmup=2)


def test_cache_key_changes_with_the_model_shape_and_nothing_else_of_it_is_ignored():
    def key(shape, **kw):
        args = dict(node_id="n0@10.0.0.1:22", threads=None, ranks=1, torch_version="2.4.0") | kw
        return steptime.cache_key(shape=steptime._shape_dict(shape), **args)

    tiny, small = get_preset("tiny"), get_preset("small")
    base = key(tiny)
    assert key(tiny) == base
    assert key(small) != base
    assert key(dataclasses.replace(tiny, batch_size=tiny.batch_size * 2)) != base
    assert key(dataclasses.replace(tiny, seq_len=tiny.seq_len // 2)) != base
    assert key(tiny, node_id="n1@10.0.0.2:22") != base
    assert key(tiny, threads=2) != base and key(tiny, ranks=2) != base
    assert key(tiny, cpu_share=0.45) != key(tiny, cpu_share=0.3)
    assert key(tiny, world=3) != key(tiny, world=4)  # the sync's work depends on the ranks' chunks


def test_measure_times_what_a_diloco_sync_adds_per_wire():
    shape = ModelShape(d_model=64, n_layer=2, n_head=2, seq_len=32, batch_size=2)
    doc = steptime.measure(shape, threads=1, world=3, budget_s=2.0)
    assert set(doc["sync_extra_s"]) == {"fp32", "bf16", "int8"}
    assert all(v >= 0 for v in doc["sync_extra_s"].values())
    assert steptime.measure(shape, threads=1, budget_s=1.0)["sync_extra_s"] is None  # one rank: no sync


def test_local_measurement_is_cached_per_shape():
    # A deliberately small model so the real measurement (a child process, torch) stays quick.
    shape = ModelShape(d_model=32, n_layer=1, n_head=2, seq_len=32, batch_size=2)
    cluster = local_cluster()
    measured, notes = steptime.node_step_times(cluster, shape, threads=1, measure_now=True, timeout_s=120)
    st = measured["local"]
    assert st.source == "measured" and st.repeats >= 3 and st.threads == 1 and st.tokens == 64
    assert 0 < st.median_s < 5 and st.spread >= 0
    cached, _ = steptime.node_step_times(cluster, shape, threads=1)
    assert cached["local"].source == "cached" and cached["local"].median_s == st.median_s
    other = dataclasses.replace(shape, batch_size=4)
    assert steptime.node_step_times(cluster, other, threads=1)[0] == {}  # another shape: not cached


def _summary(compute, comm, steps):
    return {"steps": steps, "compute_median_s": compute, "comm_mean_s": comm, "step_mean_s": compute + comm}


def test_compare_corrects_the_compute_term_from_the_window_and_judges_it_on_the_rest():
    predicted = {"label": "ddp", "step_seconds": 1.5, "compute_seconds": 1.0, "comm_seconds": 0.5,
                 "tokens_per_step": 3000, "tokens_per_s": 2000.0}
    # Two ranks: rank 1 is the slower one; its compute sets the pace, rank 0 waits (comm).
    ranks = [{"window": _summary(1.0, 0.7, 8), "rest": _summary(1.0, 0.7, 20), "all": _summary(1.0, 0.7, 28)},
             {"window": _summary(1.2, 0.5, 8), "rest": _summary(1.2, 0.5, 20), "all": _summary(1.2, 0.5, 28)}]
    doc = prediction.compare(predicted, ranks, comm_every_step=False)
    assert doc["measured"]["compute_seconds"] == pytest.approx(1.2)
    assert doc["measured"]["step_seconds"] == pytest.approx(1.7)
    assert doc["measured"]["comm_seconds"] == pytest.approx(0.5)
    assert doc["measured"]["tokens_per_s"] == pytest.approx(3000 / 1.7)
    assert doc["error"]["step_seconds"] == pytest.approx(0.2 / 1.7)
    assert doc["error"]["compute_seconds"] == pytest.approx(0.2 / 1.2)
    c = doc["corrected"]
    assert c["compute_factor"] == pytest.approx(1.2) and c["compute_seconds"] == pytest.approx(1.2)
    assert c["comm_seconds"] == 0.5 and c["step_seconds"] == pytest.approx(1.7)  # diloco-like: comm kept
    assert doc["corrected_error"]["step_seconds"] == pytest.approx(0.0)
    # DDP communicates every step: its exposed communication is taken from the window too.
    ddp = prediction.compare(predicted | {"comm_seconds": 0.1}, ranks, comm_every_step=True)
    assert ddp["corrected"]["comm_seconds"] == pytest.approx(0.5)


def test_two_rank_run_reports_predicted_vs_measured(tmp_path):
    run = tmp_path / "run"
    steps = prediction.WARMUP + prediction.K + 3
    r = run_cli("train", "--json", "--nodes", "2", "--preset", "tiny", "--batch-size", "2", "--max-steps", str(steps),
                "--eval-every", str(steps), "--checkpoint-every", str(steps), "--threads-per-rank", "1",
                "--run-dir", str(run), timeout=300, env={"HOME": str(tmp_path)})
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads(r.stdout)
    written = json.loads((run / prediction.PREDICTION).read_text())
    assert written["label"] == "ddp" and written["world_size"] == 2 and written["tokens_per_step"] == 2 * 2 * 128
    p = report["prediction"]
    assert p["predicted"]["step_seconds"] == pytest.approx(written["step_seconds"])
    m = p["measured"]
    assert m["steps"] == steps - prediction.WARMUP
    assert 0 < m["compute_seconds"] <= m["step_seconds"] < 60
    assert m["tokens_per_s"] == pytest.approx(written["tokens_per_step"] / m["step_seconds"])
    assert all(v is not None and v >= 0 for k, v in p["error"].items() if k != "comm_seconds")
    assert p["corrected"]["from_steps"] == prediction.K and p["corrected"]["comm_corrected"] is True
    assert p["measured_after_correction"]["steps"] == 3
    assert p["corrected_error"]["step_seconds"] is not None
    # The correction was recorded online, once, by rank 0 after the window.
    events = [json.loads(line.split(" ", 1)[1]) for line in (run / "logs" / "rank-0.log").read_text().splitlines()
              if line.startswith("VPSC_EVENT ")]
    online = [e for e in events if e["event"] == "prediction"]
    assert [e["step"] for e in online] == [prediction.WARMUP + prediction.K]
    assert online[0]["corrected"] == p["corrected"]


def test_plan_uses_cached_step_times_for_compute_and_says_so():
    import time

    from vpscluster.plan.api import PlanRequest, make_plan

    shape = get_preset("tiny")
    key = steptime.cache_key(steptime._node_id(local_cluster().nodes[0]), steptime._shape_dict(shape), None, 2,
                             steptime._torch_version(), world=2)
    samples = [0.40, 0.41, 0.39, 2.0, 0.40]  # one spike from another job
    steptime._write_cache({key: {"samples": samples, "threads": 1, "tokens": shape.batch_size * shape.seq_len,
                                 "measured_at_unix": time.time(),
                                 "sync_extra_s": {"fp32": 0.6, "bf16": 0.5, "int8": 0.45}}})
    doc = make_plan(PlanRequest(model="tiny", nodes=2, strategy="ddp", tokens=1e6))
    assert doc["step_calibration"]["source"] == "cached" and doc["step_calibration"]["covers_all"]
    assert [n["compute_seconds"] for n in doc["nodes"]] == [pytest.approx(0.40)] * 2
    assert doc["compute_seconds"] == pytest.approx(0.40)
    assert doc["efficiency"]["source"] == "calibrated"  # implied by the measured steps
    # DiLoCo: each node's compute also carries the measured sync work of its wire, over H.
    dl = make_plan(PlanRequest(model="tiny", nodes=2, strategy="diloco", sync_every=5, wire_dtype="bf16", tokens=1e6))
    assert dl["compute_seconds"] == pytest.approx(0.40 + 0.5 / 5)
    # Another batch size is another shape: not cached, the FLOP/s model again.
    other = make_plan(PlanRequest(model="tiny", nodes=2, strategy="ddp", tokens=1e6, batch_size=4))
    assert other["step_calibration"] is None and other["compute_seconds"] != pytest.approx(0.40)


def test_train_plans_on_the_same_cached_step_times_as_plan():
    # `train --strategy auto` and DiLoCo's rule (plan.auto.plan_inputs) must see the step `plan`
    # predicts: the cached measurement, not the FLOP/s model with an assumed efficiency.
    import time

    from vpscluster.config import build
    from vpscluster.plan import auto
    from vpscluster.plan.compute import node_compute
    from vpscluster.train.config import TrainConfig

    cfg = build(TrainConfig, {"preset": "tiny", "nodes": 2, "strategy": {"name": "diloco"}, "max_steps": 100})
    model, res, eff = auto.plan_inputs(cfg, None, None)
    assumed = [node_compute(model, n, eff.value).seconds for n in res.nodes]
    assert assumed != [pytest.approx(0.40)] * 2

    shape = get_preset("tiny")
    key = steptime.cache_key(steptime._node_id(local_cluster().nodes[0]), steptime._shape_dict(shape), None, 2,
                             steptime._torch_version(), world=2)
    steptime._write_cache({key: {"samples": [0.40, 0.41, 0.39, 0.40], "threads": 1,
                                 "tokens": shape.batch_size * shape.seq_len, "measured_at_unix": time.time()}})
    model, res, eff = auto.plan_inputs(cfg, None, None)
    assert eff.source == "calibrated"
    assert [node_compute(model, n, eff.value).seconds for n in res.nodes] == [pytest.approx(0.40)] * 2
