"""Balancing by default on uneven nodes (issue #36 item 4): the split chooser (`plan/balance.py`),
the launcher's decision (`launch/balance.py`) and its one line on `train --dry-run`."""

from __future__ import annotations

import json
import random
import time

import pytest

from vpscluster.plan.balance import balance_line, choose_split, needs_balance, scaled_steps
from vpscluster.train.shares import GAP_HINT, split, split_gap

ISSUE = [0.45, 0.45, 0.45, 0.15]  # the issue's 4 sandbox nodes, in cores


def test_ddp_keeps_the_global_batch_in_finer_micro_batches():
    # small: 4 sequences per rank, 16 in all. Whole micro-batches of 4 or 2 sequences cannot
    # split 3:3:3:1 within 10%; of 1 sequence they can (5/5/5/1 of 16, 4% longer than exact).
    c = choose_split(ISSUE, batch_size=4, micro_batches_are_steps=False)
    assert (c.micro_batches, c.batch_size, c.steps_per_step, c.sync_every) == (16, 1, 1, None)
    assert c.shares == (5, 5, 5, 1)
    assert c.gap == pytest.approx((5 / 0.45) / (16 / 1.5) - 1)
    # tiny: 16 sequences per rank; micro-batches of 4 already split it as well.
    c = choose_split(ISSUE, batch_size=16, micro_batches_are_steps=False)
    assert (c.micro_batches, c.batch_size, c.shares) == (16, 4, (5, 5, 5, 1))


def test_diloco_keeps_the_inner_step_and_the_round():
    # H = 10: 20 micro-batches of 4 sequences (inner steps) a step, 2 steps a round: 6/6/6/2 is exact.
    c = choose_split(ISSUE, batch_size=4, micro_batches_are_steps=True, sync_every=10)
    assert (c.micro_batches, c.batch_size, c.steps_per_step, c.sync_every, c.shares, c.gap) == \
        (20, 4, 5, 2, (6, 6, 6, 2), 0.0)
    # H = 20: k = 4 already comes within 10%, so a round is 5 steps of 16.
    c = choose_split(ISSUE, batch_size=4, micro_batches_are_steps=True, sync_every=20)
    assert (c.micro_batches, c.sync_every, c.shares) == (16, 5, (5, 5, 5, 1))
    # A round keeps the steps it needs (fragments, an overlapped sync): here 5, so k = 2.
    c = choose_split(ISSUE, batch_size=4, micro_batches_are_steps=True, sync_every=10, min_round_steps=5)
    assert c.sync_every == 5 and c.micro_batches == 8
    # Speeds 3.6x apart: only k = 10 (rounds of one step, whose sync cannot overlap) comes within
    # 10%; rounds of at least 2 steps keep the overlapped sync, at the best gap they allow.
    skewed = [0.462, 0.4594, 0.4913, 0.1359]
    assert choose_split(skewed, 4, True, 10).sync_every == 1
    c = choose_split(skewed, 4, True, 10, min_round_steps=2)
    assert (c.sync_every, c.shares) == (2, (6, 6, 7, 1)) and GAP_HINT < c.gap < 0.11


def test_even_enough_or_too_coarse_is_no_split():
    assert not needs_balance([0.45, 0.45, 0.45, 0.40])  # 12.5% apart
    assert needs_balance([0.45, 0.45, 0.45, 0.38])  # 18% apart
    assert choose_split([0.45, 0.45, 0.45, 0.40], 4, False) is None
    assert choose_split([0.75, 0.25], 1, False) is None  # one sequence per rank: only the even split
    assert choose_split([0.75, 0.25], 4, True, sync_every=1) is None  # H = 1: one inner step a rank


def test_random_speeds_keep_the_batch_and_come_within_the_gap():
    rng = random.Random(36)
    for _ in range(300):
        world = rng.randint(2, 6)
        speeds = [rng.uniform(0.1, 1.0) for _ in range(world)]
        steps = rng.random() < 0.5
        batch, H = rng.choice([4, 8, 16]), rng.choice([5, 10, 20, 50])
        c = choose_split(speeds, batch, steps, H if steps else None)
        if not needs_balance(speeds):
            assert c is None
            continue
        if c is None:  # only when no finer split beats one micro-batch per rank
            finest = H if steps else batch
            assert split_gap(split(speeds, finest * world, 1, 8.0), speeds, 8.0) >= split_gap([1] * world, speeds, 8.0)
            continue
        assert sum(c.shares) == c.micro_batches > world and min(c.shares) >= 1
        if steps:  # the inner step and the inner steps (and tokens) per round are kept
            assert c.batch_size == batch and c.sync_every * c.steps_per_step == H
            assert c.micro_batches == c.steps_per_step * world
        else:  # the global batch is kept
            assert c.micro_batches * c.batch_size == world * batch
        assert c.gap == pytest.approx(split_gap(list(c.shares), speeds, 8.0))
        if c.gap > GAP_HINT:  # only when no granularity allowed comes within it
            ks = [k for k in range(2, (H if steps else batch) + 1) if (H if steps else batch) % k == 0]
            assert all(split_gap(split(speeds, k * world, 1, 8.0), speeds, 8.0) > GAP_HINT for k in ks)
        else:  # the first (coarsest) that does
            assert c.micro_batches == min(k * world for k in range(2, 51) if (H if steps else batch) % k == 0
                                          and split_gap(split(speeds, k * world, 1, 8.0), speeds, 8.0) <= GAP_HINT)


def test_scaled_steps_and_the_line():
    assert scaled_steps(200, 5) == 40 and scaled_steps(7, 5) == 2 and scaled_steps(1, 5) == 1
    assert scaled_steps(100, 5, multiple_of=3) == 21  # checkpoints on outer steps
    c = choose_split(ISSUE, 4, True, 10)
    speeds = dict(zip(["node-1", "node-2", "node-3", "node-4"], ISSUE))
    line = balance_line(speeds, {n: 1 for n in speeds}, c)
    assert line.startswith("balancing: node-4 is 3.0x slower than node-1; micro-batches 6/6/6/2 of 20 a step")
    assert line.endswith("(--no-balance to turn off)") and "\n" not in line


@pytest.fixture
def uneven_cluster(tmp_path):
    """A cluster file of 4 nodes (never contacted: dry runs) and a saved probe of 3:3:3:1 FLOP/s."""
    from vpscluster.cluster.inventory import load_cluster
    from vpscluster.probe.store import fingerprint, save_probe

    (tmp_path / "id_test").write_text("not a real key\n")
    path = tmp_path / "cluster.yaml"
    path.write_text(f"defaults: {{identity_file: {tmp_path / 'id_test'}, python: /opt/venv/bin/python, "
                    "workdir: /srv/vpscluster}\nnodes:\n"
                    + "".join(f"  - {{name: node-{i}, host: 203.0.113.{10 + i}}}\n" for i in range(1, 5)))

    def probe(flops: list[float], cpu_shares: list[float] | None = None) -> None:
        c = load_cluster(str(path))
        nodes = [{"name": f"node-{i + 1}", "flops": f, "gpus": []} for i, f in enumerate(flops)]
        for node, share in zip(nodes, cpu_shares or []):
            node["cpu_share"] = share
        save_probe(c, {"cluster": {"fingerprint": fingerprint(c)}, "probed_at_unix": time.time(), "links": [],
                       "problems": [], "nodes": nodes})

    probe([f * 1e11 for f in ISSUE])
    return path, probe


def _dry(cli, cluster, *flags):
    r = cli("train", "--cluster", str(cluster), "--dry-run", "--json", "--preset", "small", "--run-dir", "runs/fixed",
            *flags, timeout=120, cwd=str(cluster.parent))
    assert r.returncode == 0, r.stderr
    return [n for n in json.loads(r.stdout)["notes"] if n.startswith("balancing")]


def test_dry_run_says_balancing_in_one_line_and_no_balance_turns_it_off(cli, uneven_cluster):
    cluster, probe = uneven_cluster
    assert _dry(cli, cluster, "--strategy", "ddp") == [
        "balancing: node-4 is 3.0x slower than node-1; micro-batches 5/5/5/1 of 16 a step, 1 sequence each "
        "(--no-balance to turn off)"]
    assert _dry(cli, cluster, "--strategy", "ddp", "--no-balance") == []
    # auto: the plan chooses before the launch (ddp or diloco), and the choice is balanced alike
    assert len(_dry(cli, cluster, "--strategy", "auto")) == 1
    assert _dry(cli, cluster, "--strategy", "ddp", "--micro-batches", "8") == []  # explicit flags win
    assert _dry(cli, cluster, "--strategy", "ddp", "--speeds", "1,1,1,1", "--micro-batches", "8") == []
    probe([4.5e10, 4.5e10, 4.5e10, 4.0e10])  # 12.5% apart: the even split
    assert _dry(cli, cluster, "--strategy", "ddp") == []
    # The same CPU share everywhere: a 3x spread in the quick FLOP/s is a busy host's noise.
    probe([f * 1e11 for f in ISSUE], cpu_shares=[0.45] * 4)
    assert _dry(cli, cluster, "--strategy", "ddp") == []
    probe([f * 1e11 for f in ISSUE], cpu_shares=[0.45, 0.45, 0.45, 0.15])  # and the shares say it is not
    assert len(_dry(cli, cluster, "--strategy", "ddp")) == 1
    assert list(cluster.parent.glob("runs")) == []  # a dry run creates nothing


def test_the_decision_lands_in_the_runs_config(uneven_cluster):
    from vpscluster.launch.train import prepare_training
    from vpscluster.train.config import StrategyConfig, TrainConfig

    cluster, probe = uneven_cluster
    cfg = TrainConfig(cluster=str(cluster), preset="small", max_steps=200, strategy=StrategyConfig(name="diloco"))
    run = prepare_training(cfg)
    c, s = run.cfg, run.cfg.strategy
    assert "6/6/6/2" in run.speeds_note and s.balance is True
    assert s.launcher.node_speeds == {f"node-{i + 1}": pytest.approx(v * 1e11) for i, v in enumerate(ISSUE)}
    # The same inner steps per round and tokens per run: 20 micro-batches of 4, rounds of 2 steps
    # of 5x the tokens, a fifth of the steps on the same LR schedule; the inner lr of 4 replicas.
    assert (c.batch_size, s.micro_batches, s.sync_every, c.max_steps, c.lr_decay_steps) == (4, 20, 2, 40, 40)
    assert c.checkpoint_every % s.sync_every == 0 and s.inner_lr_scale == pytest.approx(0.5)
    assert run.prediction is None  # the plan predicts the even split only
    probe([4.5e10] * 4)
    even = prepare_training(TrainConfig(cluster=str(cluster), preset="small", strategy=StrategyConfig(name="ddp")))
    assert even.speeds_note is None and even.cfg.strategy.balance is False and not even.cfg.strategy.micro_batches


def test_a_strategy_that_keeps_even_shares_is_not_balanced():
    from vpscluster.launch.balance import apply_default_balance
    from vpscluster.train.config import StrategyConfig, TrainConfig

    probe = {"nodes": [{"name": f"node-{i + 1}", "flops": f * 1e11, "gpus": []} for i, f in enumerate(ISSUE)]}
    ranks = {f"node-{i + 1}": 1 for i in range(len(ISSUE))}
    flat = TrainConfig(preset="small", strategy=StrategyConfig(name="diloco"))
    assert apply_default_balance(flat, probe, ranks) and flat.strategy.micro_batches  # these nodes are balanced
    # hierarchical runs DDP inside a region: no uneven shares yet (its companion's uneven_shares)
    hier = TrainConfig(preset="small", strategy=StrategyConfig(name="hierarchical"))
    assert apply_default_balance(hier, probe, ranks) is None
    assert hier.strategy.balance is False and not hier.strategy.micro_batches and hier.strategy.launcher.node_speeds is None


def test_capacity_is_what_a_node_is_given_not_a_share_measured_under_load():
    from vpscluster.launch.balance import capacities_differ

    def probe(*nodes):
        return {"nodes": [{"name": f"n{i}", "gpus": [], **n} for i, n in enumerate(nodes)]}

    names = ["n0", "n1"]
    busy = ({"cpu_affinity": 2, "cpu_quota_cores": None, "cpu_share": 2.0, "cpu_share_source": "affinity"},
            {"cpu_affinity": 2, "cpu_quota_cores": None, "cpu_share": 1.1, "cpu_share_source": "measured"})
    assert not capacities_differ(probe(*busy), names)  # the same two cores: a loaded host's reading is noise
    quotas = ({"cpu_affinity": 2, "cpu_quota_cores": 0.75}, {"cpu_affinity": 2, "cpu_quota_cores": 0.25})
    assert capacities_differ(probe(*quotas), names)
    assert capacities_differ(probe({}, {}), names)  # nothing known: the measured speeds decide


def test_diloco_moves_the_plans_h_to_one_that_splits_better_and_keeps_the_users():
    # Measured speeds 3.6x apart (bench uneven): at H = 10 the best round of >= 2 steps is
    # 6/6/7/1 of 20, 10% over exact; H = 8 (k = 4: 5/5/5/1 of 16) comes within 6%.
    from vpscluster.launch.balance import apply_default_balance
    from vpscluster.plan.balance import choose_split_near
    from vpscluster.train.config import LauncherChoices, StrategyConfig, TrainConfig

    skewed = [0.462, 0.4594, 0.4913, 0.1359]
    h, c = choose_split_near(skewed, 4, 10, min_round_steps=2)
    assert (h, c.micro_batches, c.shares, c.sync_every) == (8, 16, (5, 5, 5, 1), 2) and c.gap < GAP_HINT
    assert choose_split_near(ISSUE, 4, 10, min_round_steps=2)[0] == 10  # H itself splits exactly: kept
    for h0 in (5, 10, 20, 30, 50):  # never further than a quarter away, never a worse split
        h, c = choose_split_near(skewed, 4, h0, min_round_steps=2)
        base = choose_split(skewed, 4, True, h0, min_round_steps=2)
        assert abs(h - h0) <= 0.25 * h0 + 1 and (base is None or c.gap <= base.gap)
        assert c is not None  # H = 5 alone has no round of >= 2 steps to split; 4 or 6 have

    probe = {"nodes": [{"name": f"node-{i + 1}", "flops": f * 1e11, "gpus": []} for i, f in enumerate(skewed)]}
    ranks = {f"node-{i + 1}": 1 for i in range(4)}
    planned = TrainConfig(preset="small", max_steps=200,
                          strategy=StrategyConfig(name="diloco", sync_every=10, overlap_steps=1,
                                                  launcher=LauncherChoices(planned=["sync_every"])))
    line = apply_default_balance(planned, probe, ranks)
    assert "H = 8 instead of the plan's 10" in line and planned.strategy.sync_every == 2, line
    assert planned.max_steps == 50  # 200 inner steps in steps of 4x the tokens
    users = TrainConfig(preset="small", max_steps=200,
                        strategy=StrategyConfig(name="diloco", sync_every=10, overlap_steps=1))
    line = apply_default_balance(users, probe, ranks)
    assert "instead of" not in line and users.strategy.sync_every == 2 and users.strategy.micro_batches == 20


def _script_job(cluster, tmp_path, session, said):
    from vpscluster.cluster.inventory import load_cluster
    from vpscluster.launch.run import script_job

    (tmp_path / "train_me.py").write_text("print('hi')\n")
    return script_job(load_cluster(str(cluster)), ["python", "train_me.py"], sync=str(tmp_path),
                      run_dir=str(tmp_path / "runs" / "x"), session=session, say=said.append)


def test_run_decides_like_train_for_a_session(uneven_cluster, tmp_path):
    """`vpscluster run` on the same cluster and saved probe: train's decision, for the session
    the script starts. diloco: inner steps of the script's batch, 6/6/6/2 of 20 a step, rounds of
    H / 5 steps (the same inner steps per round); the script's lr untouched; one line."""
    from vpscluster.session.config import SessionConfig, read, write
    from vpscluster.train.config import StrategyConfig

    cluster, probe = uneven_cluster
    said: list[str] = []
    session = SessionConfig(strategy=StrategyConfig(name="diloco", sync_every=10), checkpoint_every=20)
    _script_job(cluster, tmp_path, session, said)
    s = session.strategy
    assert len(said) == 1 and said[0].startswith("balancing: node-4 is 3.0x slower than node-1; batches 6/6/6/2 "
                                                 "of 20 a step (each of the script's batch size)"), said
    assert said[0].endswith("(--no-balance to turn off)")
    assert (s.balance, s.micro_batches, s.sync_every, session.checkpoint_every) == (True, 20, 2, 4)
    assert s.launcher.node_speeds == {f"node-{i + 1}": pytest.approx(v * 1e11) for i, v in enumerate(ISSUE)}
    assert s.inner_lr_scale == 0.0  # the session steps with the script's own lr
    assert read(write(session, tmp_path)).strategy.micro_batches == 20  # what session.json carries
    _script_job(cluster, tmp_path, session, said)  # decided once: a relaunch keeps the split, silently
    assert len(said) == 1 and s.micro_batches == 20

    # --no-balance, and a given split, are left alone.
    for strategy in (StrategyConfig(name="diloco", balance=False), StrategyConfig(name="diloco", micro_batches=8)):
        session = SessionConfig(strategy=strategy)
        before = dict(vars(strategy))
        _script_job(cluster, tmp_path, session, said)
        assert vars(session.strategy) == before and len(said) == 1

    # ddp: the step's world x B samples in parts, one batch a rank sized by its parts, decided once.
    session = SessionConfig(strategy=StrategyConfig(name="ddp"))
    _script_job(cluster, tmp_path, session, said)
    s = session.strategy
    assert (s.balance, s.micro_batches, s.sync_every) == (True, 20, StrategyConfig().sync_every)  # ddp: no rounds
    assert said[-1] == ("balancing: node-4 is 3.0x slower than node-1; batches 1.2/1.2/1.2/0.4 x the script's batch "
                        "size a rank (shares 6/6/6/2 of 20), each rank's gradient weighted by its batch "
                        "(--no-balance to turn off)")
    assert read(write(session, tmp_path)).strategy.micro_batches == 20
    n = len(said)
    _script_job(cluster, tmp_path, session, said)  # a relaunch keeps it, silently
    assert len(said) == n and s.micro_batches == 20
    session = SessionConfig(strategy=StrategyConfig(name="ddp", balance=False))  # --no-balance: even
    _script_job(cluster, tmp_path, session, said)
    assert not session.strategy.micro_batches and len(said) == n

    # The same CPUs everywhere (a FLOP/s spread that is noise): decided even, nothing said.
    probe([f * 1e11 for f in ISSUE], cpu_shares=[0.45] * 4)
    session = SessionConfig(strategy=StrategyConfig(name="diloco"))
    n = len(said)
    _script_job(cluster, tmp_path, session, said)
    assert session.strategy.balance is False and not session.strategy.micro_batches and len(said) == n


def test_run_flags_balance():
    import argparse

    from vpscluster.cli.run import add_arguments, session_settings

    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(["--cluster", "c.yaml", "--no-balance", "--", "python", "x.py"])
    assert session_settings(args).strategy.balance is False
    args = p.parse_args(["--cluster", "c.yaml", "--", "python", "x.py"])
    assert session_settings(args).strategy.balance is None  # undecided: the launcher decides


def test_run_balances_an_auto_session_as_ddp_and_says_one_line(cli, uneven_cluster, tmp_path):
    """`run --strategy auto` on uneven nodes: auto starts as ddp, so the session gets ddp's split
    (parts of its step, decided once, balancing on); the line says it and what a switch to diloco
    does with it. `--no-balance` and explicit shares are left alone. Through the CLI's dry run too."""
    from vpscluster.session.config import SessionConfig, read, write
    from vpscluster.train.config import StrategyConfig

    cluster, _ = uneven_cluster
    said: list[str] = []
    session = SessionConfig(strategy=StrategyConfig(name="auto"))
    _script_job(cluster, tmp_path, session, said)
    s = session.strategy
    assert (s.name, s.balance, s.micro_batches) == ("auto", True, 20)
    assert s.launcher.node_speeds == {f"node-{i + 1}": pytest.approx(v * 1e11) for i, v in enumerate(ISSUE)}
    assert said == ["balancing: node-4 is 3.0x slower than node-1; batches 1.2/1.2/1.2/0.4 x the script's batch size "
                    "a rank (shares 6/6/6/2 of 20), each rank's gradient weighted by its batch; if auto switches to "
                    "diloco, the split is re-chosen from the speeds measured under ddp (--no-balance to turn off)"]
    back = read(write(session, tmp_path))  # what session.json carries: the session takes it (no refusal)
    assert (back.strategy.name, back.strategy.micro_batches, back.strategy.balance) == ("auto", 20, True)
    _script_job(cluster, tmp_path, session, said)  # decided once: a relaunch keeps the split, silently
    assert len(said) == 1
    for strategy in (StrategyConfig(name="auto", balance=False), StrategyConfig(name="auto", micro_batches=8)):
        session = SessionConfig(strategy=strategy)
        before = dict(vars(strategy))
        _script_job(cluster, tmp_path, session, said)
        assert vars(session.strategy) == before and len(said) == 1

    (tmp_path / "train_me.py").write_text("print('hi')\n")
    r = cli("run", "--cluster", str(cluster), "--dry-run", "--strategy", "auto", "--", "python", "train_me.py",
            timeout=120, cwd=str(tmp_path))
    assert r.returncode == 0, r.stderr
    lines = [line for line in (r.stdout + r.stderr).splitlines() if line.startswith("balancing:")]
    assert len(lines) == 1 and "if auto switches to diloco" in lines[0], r.stdout + r.stderr
