"""DiLoCo's sync plan re-made on the measured step (train/replan.py).

- The rule applied again is a pure function of the plan's inputs and the measured step: within
  the tolerance the plan stands; far off it, the settings are the rule's on the measured step,
  and only the keys the user left open change.
- The launcher's plan carries those inputs (`plan_diloco`).
- Through the real trainer on 2 gloo ranks, planned on a step 1000x too slow: both ranks switch
  at the same step to the same settings, the outer syncs then fall on the new H, both end with
  identical weights, and a resumed run goes on with the re-made settings.
"""

from __future__ import annotations

import os

import pytest

from test_diloco_overlap import run_trainer_ranks


def _inputs(**over):
    from vpscluster.train.config import ReplanInputs

    doc = {"step_seconds": 5.48, "step_source": "FLOP/s x efficiency", "bandwidth_bytes_s": 12.5e6 * 0.95,
           "latency_s": 0.001, "num_params": 10844160.0, "choices": [10, 20, 25, 50, 100],
           "wires": ["fp32", "bf16", "int8"], "keys": ["outer_lr", "outer_momentum", "outer_warmup", "sync_every",
                                                     "wire_dtype"]}
    return ReplanInputs(**{**doc, **over})


CURRENT = {"sync_every": 10, "wire_dtype": "int8", "outer_lr": 0.5, "outer_momentum": 0.9, "outer_warmup": 10}


def test_within_the_tolerance_the_plan_stands():
    from vpscluster.train import replan

    inputs = _inputs()
    for step in (5.48, 5.48 * (1 + replan.TOLERANCE * 0.99), 5.48 * (1 - replan.TOLERANCE * 0.99)):
        assert replan.plan_again(inputs, step, 4, CURRENT) is None
    assert replan.plan_again(inputs, None, 4, CURRENT) is None  # nothing measured
    assert replan.plan_again(inputs, 2.03, 1, CURRENT) is None  # one rank: nothing to sync


def test_far_off_the_plan_the_rule_is_applied_to_the_measured_step():
    from vpscluster.train.strategies import sync_rule
    from vpscluster.train import replan

    inputs = _inputs()
    # bench wan, 2026-12-04: 5.48 s planned from FLOP/s, 2.03 s measured.
    new, reason = replan.plan_again(inputs, 2.03, 4, CURRENT)
    expected = sync_rule.choose_sync(inputs.bandwidth_bytes_s, 2.03, inputs.num_params, 4, latency_s=0.001,
                                     choices=(10, 20, 25, 50, 100)).settings()
    assert new == {k: v for k, v in expected.items() if CURRENT[k] != v}
    assert new["sync_every"] == 20 and "wire_dtype" not in new  # int8 stays; H doubles
    assert reason.startswith("measured 2.03 s per inner step against 5.48 s planned") and "H=10 int8 -> H=20 int8" in reason
    # Slower than planned: H never grows for a slower step.
    slower, _ = replan.plan_again(_inputs(step_seconds=2.03), 5.48, 4, {**CURRENT, "sync_every": 20})
    assert slower["sync_every"] == 10


def test_the_overlap_counts_as_the_launcher_planned_it():
    from vpscluster.train import replan

    # With τ = 1 (the default) the measured 2.03 s hides int8's 1.37-s sync at H = 10: from the
    # plan's H = 10 bf16 (hidden behind 5.48 s) only the wire changes.
    new, reason = replan.plan_again(_inputs(), 2.03, 4, {**CURRENT, "wire_dtype": "bf16"}, overlap_steps=1)
    assert new == {"wire_dtype": "int8"} and "H=10 bf16 -> H=10 int8" in reason and "hidden behind 1" in reason
    assert replan.plan_again(_inputs(), 2.03, 4, CURRENT, overlap_steps=1) is None  # already what the rule wants


def test_the_egress_quota_holds_on_the_measured_step():
    from vpscluster.train.strategies import sync_rule
    from vpscluster.train import replan

    # A run as long as the quota's period sends per second: a step 2.7x faster than planned sends
    # 2.7x the bytes per day, so the quota that H = 10 int8 kept on the plan's step needs H = 25.
    month = 30 * 86400
    per_step = sync_rule.sync_bytes(10844160.0, 4, "int8") / 10
    quota = 1.2 * per_step * month / 5.48
    inputs = _inputs(egress_quotas=[[quota, month]] * 4)
    new, reason = replan.plan_again(inputs, 2.03, 4, CURRENT, overlap_steps=1)
    assert new["sync_every"] == 25 and "egress quota allows" in reason
    assert replan.plan_again(_inputs(), 2.03, 4, CURRENT, overlap_steps=1) is None  # without it, H = 10 stays
    from vpscluster.errors import UserError

    with pytest.raises(UserError, match="egress_quotas"):
        _inputs(egress_quotas=[[quota]])


def test_only_the_keys_left_open_change():
    from vpscluster.train import replan

    fixed_h = _inputs(keys=["outer_lr", "outer_momentum", "outer_warmup"], choices=[10])
    assert replan.plan_again(fixed_h, 2.03, 4, CURRENT) is None  # H set by the user: its outer lr is already right
    wire_open = _inputs(keys=["wire_dtype"], choices=[10])
    assert replan.plan_again(wire_open, 50.0, 4, CURRENT)[0] == {"wire_dtype": "fp32"}  # a slow step affords fp32


def test_the_launchers_plan_carries_the_rules_inputs(tmp_path, monkeypatch):
    from test_plan_auto import _diloco_cfg, _inputs as plan_inputs

    from vpscluster.plan import auto

    # no cached step times (as test_plan_auto's fixture)
    monkeypatch.setattr("vpscluster.plan.calibrate._cache_path", lambda: tmp_path / "calibration.json")
    cfg = _diloco_cfg(sync_every=50)
    model, res, eff = plan_inputs(cfg, 20.0)
    s = auto.plan_diloco(cfg, model, res, eff, given={"sync_every"})
    step_s, beta, alpha = auto.rule_inputs(model, res, eff)
    r = s.launcher.replan
    assert (r.step_seconds, r.bandwidth_bytes_s, r.latency_s, r.num_params) == (step_s, beta, alpha, model.num_params())
    assert r.choices == [50] and r.wires == ["fp32", "bf16", "int8"] and r.keys == s.launcher.planned
    assert r.step_source == "FLOP/s x efficiency"
    everything = auto.plan_diloco(cfg, model, res, eff, given={"sync_every", "wire_dtype", "outer_lr",
                                                                "outer_momentum", "outer_warmup"})
    assert everything.launcher.replan is None  # nothing left to plan: nothing to re-make


# -- through the trainer, 2 gloo ranks -----------------------------------------------------------------

H0, MAX_STEPS, CKPT = 10, 80, 40


def _rank(rank, world, port, run_dir, max_steps, resume):
    from vpscluster.train import checkpoint
    from vpscluster.train.config import LauncherChoices, ReplanInputs, StrategyConfig, TrainConfig
    from vpscluster.train.strategies.diloco import DiLoCoStrategy
    from vpscluster.train.trainer import Trainer

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    synced_at = []  # the loop step of every outer update (recorded, the update itself untouched)
    update = DiLoCoStrategy._outer_update

    def recording(self, f, delta):
        synced_at.append(self._step)
        update(self, f, delta)

    DiLoCoStrategy._outer_update = recording
    # The plan thought a step takes 100 s on a 1 MB/s ring: fp32 at H = 10. A tiny step takes a
    # few ms, so the rule on the measured step wants int8 and the largest H allowed.
    replan = ReplanInputs(step_seconds=100.0, step_source="FLOP/s x efficiency", bandwidth_bytes_s=1e6, latency_s=0.0,
                          num_params=1040768.0, choices=[10, 20, 40], wires=["fp32", "bf16", "int8"],
                          keys=["outer_lr", "outer_momentum", "outer_warmup", "sync_every", "wire_dtype"])
    cfg = TrainConfig(preset="tiny", max_steps=max_steps, eval_every=10**6, checkpoint_every=CKPT, eval_batches=1,
                      batch_size=2, exporters=False, threads_per_rank=1, lr_decay_steps=MAX_STEPS,
                      strategy=StrategyConfig(name="diloco", sync_every=H0, wire_dtype="fp32", outer_lr=0.5,
                                              outer_warmup=10, launcher=LauncherChoices(replan=replan)))
    trainer = Trainer(cfg, run_dir, backend="gloo")
    try:
        report = trainer.train(resume=resume)
        return {"report": report, "synced_at": synced_at, "settings": trainer.strategy.describe(),
                "sha": checkpoint.state_hash(trainer.strategy.unwrap().state_dict()),
                "replanned": trainer.replanned}
    finally:
        trainer.close()


def _run(run_dir, max_steps, resume):
    return tuple(run_trainer_ranks(_rank, 2, str(run_dir), max_steps, resume))


@pytest.mark.slow  # two short runs of 2 ranks; start-up dominates
def test_ranks_switch_together_and_a_resumed_run_keeps_the_new_settings(tmp_path):
    from vpscluster.train.strategies import sync_rule
    from vpscluster.train import prediction, replan

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    a, b = _run(run_dir, MAX_STEPS, resume=False)
    window_end = prediction.WARMUP + prediction.K
    for r in (a, b):
        rp = r["replanned"]
        assert rp["step"] == window_end and rp["before"]["sync_every"] == H0 and rp["before"]["wire_dtype"] == "fp32"
        assert rp["measured_step_seconds"] < 100.0 * (1 - replan.TOLERANCE)
        want = sync_rule.choose_sync(1e6, rp["measured_step_seconds"], 1040768.0, 2, choices=(10, 20, 40)).settings()
        assert rp["after"] == want and want["sync_every"] == 40 and want["wire_dtype"] == "int8"
        assert r["settings"]["sync_every"] == 40 and r["settings"]["wire_dtype"] == "int8"
        # The first sync H0 planned (step 10) never came: sent at step 40 (the new H), landed one
        # step later (overlap 1), and the last one at the end.
        assert r["synced_at"] == [41, 80]
    # The same figures on both ranks gave the same settings at the same step, so the same weights.
    assert a["replanned"]["after"] == b["replanned"]["after"] and a["sha"] == b["sha"]
    assert a["report"]["strategy_replanned"]["after"]["sync_every"] == 40
    assert a["report"]["strategy_details"]["sync_every"] == 40  # the report's settings are those that ran

    # A resumed session starts from the checkpoint's settings (not the launch-time H0, fp32) and
    # measures again: still far off the plan, the same choice, so nothing to re-make.
    a2, b2 = _run(run_dir, MAX_STEPS + 40, resume=True)
    for r in (a2, b2):
        assert r["replanned"] is None and r["settings"]["sync_every"] == 40 and r["settings"]["wire_dtype"] == "int8"
        # The update sent at step 80 lands at 81 (the checkpoint keeps the state before the run's
        # final sync, and resumes it as sent), then the next H = 40 round ends the run at 120.
        assert r["synced_at"] == [81, 120]
    assert a2["sha"] == b2["sha"]
