"""Uneven shares on real gloo processes: the trainer's own step (`Trainer._shared_step`).

- ddp, 2 ranks with shares 3:1 and 3 ranks with shares 2:0:1 (a rank with no micro-batch still
  joins the all-reduce): the synchronised gradient equals a single process's gradient on the
  concatenated global batch, and the model after two AdamW steps equals the single-process one.
- diloco, 2 ranks with shares 3:1: the fast rank does three inner steps per loop step, the slow
  one one; both arrive at the outer sync together and leave it with identical weights.
"""

from __future__ import annotations

import os

import pytest
import torch

from conftest import free_port

STEPS = 2


def _cfg(world: int, micro: int, speeds, strategy: str = "ddp", **extra):
    from vpscluster.train.config import StrategyConfig, TrainConfig

    if strategy == "diloco":
        extra.setdefault("overlap_steps", 0)  # a blocking sync: every rank identical right at step 2
    s = StrategyConfig(name=strategy, micro_batches=micro, speeds=speeds, min_share=0, max_spread=0, sync_every=2, **extra)
    return TrainConfig(preset="tiny", batch_size=2, nodes=world, threads_per_rank=1, warmup_steps=0, strategy=s,
                       checkpoint_every=2)


def _worker(rank: int, world: int, port: int, out_dir: str, micro: int, speeds, strategy: str) -> None:
    from vpscluster.train.checkpoint import state_hash
    from vpscluster.train.trainer import Trainer, lr_at

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    cfg = _cfg(world, micro, speeds, strategy)
    trainer = Trainer(cfg, out_dir, backend="gloo")
    try:
        trainer.build()
        out = {"shares": list(trainer.shares.shares), "grads": [], "hashes": [], "counts": []}
        for step in range(1, STEPS + 1):
            trainer.step = step
            for g in trainer.optimizer.param_groups:
                g["lr"] = lr_at(cfg, step)
            _, n = trainer._shared_step()
            out["counts"].append(n)
            model = trainer.strategy.unwrap()
            out["grads"].append({k: (p.grad.clone() if p.grad is not None else None) for k, p in model.named_parameters()})
            out["hashes"].append(state_hash(model.state_dict()))
            trainer.optimizer.zero_grad(set_to_none=True)
        out["params"] = {k: v.clone() for k, v in trainer.strategy.unwrap().state_dict().items()}
        torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        trainer.close()


def _spawn(tmp_path, world, micro, speeds, strategy="ddp"):
    import torch.multiprocessing as mp

    mp.spawn(_worker, args=(world, free_port(), str(tmp_path), micro, speeds, strategy), nprocs=world, join=True)
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world)]


def _reference(world, micro, speeds):
    """One process, one forward over the whole global batch per step, the trainer's AdamW."""
    from vpscluster.train.data import GlobalBatchSampler, load_dataset
    from vpscluster.train.model import build_model
    from vpscluster.train.presets import get_preset
    from vpscluster.train.trainer import _adamw, lr_at

    cfg = _cfg(world, micro, speeds)
    shape = get_preset("tiny")
    model = build_model(shape, cfg.seed)
    opt = _adamw(model, cfg, fused=False)
    sampler = GlobalBatchSampler(load_dataset(None, shape.seq_len, cfg.val_fraction), cfg.seed, cfg.micro_batch())
    grads = []
    for step in range(1, STEPS + 1):
        parts = sampler.next_step([micro], 0)  # the step's micro-batches, all on one rank
        x, y = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
        for g in opt.param_groups:
            g["lr"] = lr_at(cfg, step)
        model(x, y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        grads.append({k: p.grad.clone() for k, p in model.named_parameters()})
        opt.step()
        opt.zero_grad(set_to_none=True)
    return grads, model.state_dict()


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world,micro,speeds,shares", [(2, 4, [3.0, 1.0], [3, 1]), (3, 3, [2.0, 0.01, 1.0], [2, 0, 1])])
def test_uneven_ddp_equals_single_process_full_batch(tmp_path, world, micro, speeds, shares):
    results = _spawn(tmp_path, world, micro, speeds)
    assert all(r["shares"] == shares for r in results)
    assert [r["counts"][0] for r in results] == shares
    ref_grads, ref_params = _reference(world, micro, speeds)
    for r in results:
        for step in range(STEPS):
            for name, g in ref_grads[step].items():
                torch.testing.assert_close(r["grads"][step][name], g, rtol=1e-4, atol=1e-6, msg=f"step {step + 1} {name}")
        for name, v in ref_params.items():
            # Adam divides by sqrt(v): where a gradient is near zero (the key bias's is zero in
            # exact arithmetic), float reordering - the sum over micro-batches and ranks vs one
            # big batch - moves single elements by up to a few 1e-5. Allow 1e-4 (3% of one
            # step's lr) for any element; on average the tensors agree to better than 1e-6.
            diff = (r["params"][name] - v).abs()
            assert float(diff.max()) < 1e-4, (name, float(diff.max()))
            assert float(diff.mean()) < 1e-6, (name, float(diff.mean()))
    # every rank holds the same model after each step
    assert len({tuple(r["hashes"]) for r in results}) == 1


@pytest.mark.timeout(600)
def test_uneven_diloco_fast_rank_does_more_inner_steps_and_all_meet_at_the_sync(tmp_path):
    results = _spawn(tmp_path, 2, 4, [3.0, 1.0], strategy="diloco")
    assert [r["counts"] for r in results] == [[3, 3], [1, 1]]
    # step 1: local inner steps only, the ranks differ; step 2 (= sync_every): outer sync, identical
    assert results[0]["hashes"][0] != results[1]["hashes"][0]
    assert results[0]["hashes"][1] == results[1]["hashes"][1]


def _look_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    import time

    from vpscluster.train.trainer import Trainer

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    cfg = _cfg(world, 4, [1.0, 1.0], balance=True)
    trainer = Trainer(cfg, out_dir, backend="gloo")
    try:
        trainer.build()
        trainer.step = 5
        trainer._window = [1.0, 10]
        if rank == 1:
            time.sleep(1.5)  # the slow rank: rank 0 waits for it at the look's gather
        trainer._rebalance()
        pending = trainer.strategy.comm.take()
        booked = trainer.totals.comm_seconds
        trainer.step = 6
        t0 = time.perf_counter()
        trainer._shared_step()  # the next step: its communication is its own all-reduce only
        step_s = time.perf_counter() - t0
        next_comm, _ = trainer.strategy.comm.take()
        torch.save({"pending": pending, "booked": booked, "next_comm": next_comm, "step_s": step_s},
                   os.path.join(out_dir, f"look{rank}.pt"))
    finally:
        trainer.close()


@pytest.mark.timeout(600)
def test_a_looks_wait_is_booked_as_communication_not_charged_to_the_next_step(tmp_path):
    """Rank 0 waits ~1.5 s for rank 1 at a look. That wait is the run's communication, booked at
    once; the next step's communication is its own (so its compute, and the next window's speed,
    are not understated by the wait)."""
    import torch.multiprocessing as mp

    mp.spawn(_look_worker, args=(2, free_port(), str(tmp_path)), nprocs=2, join=True)
    fast = torch.load(tmp_path / "look0.pt", weights_only=False)
    assert fast["pending"] == (0.0, 0)
    assert fast["booked"] >= 1.2
    assert fast["next_comm"] < 1.0 and fast["next_comm"] <= fast["step_s"]


def _eval_worker(rank: int, world: int, port: int, out_dir: str, strategy: str) -> None:
    from vpscluster.train.checkpoint import state_hash
    from vpscluster.train.trainer import Trainer

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    cfg = _cfg(world, 4, [3.0, 1.0], strategy)
    trainer = Trainer(cfg, out_dir, backend="gloo")
    try:
        trainer.build()
        share = list(trainer._eval_share(8))
        model = trainer.strategy.unwrap()
        if strategy == "diloco":  # each replica off on its own, as between outer syncs
            gen = torch.Generator().manual_seed(100 + rank)
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(0.05 * torch.randn(p.shape, generator=gen))
        before = state_hash(model.state_dict())
        val = trainer.evaluate()
        torch.save({"val": val, "share": share, "restored": state_hash(model.state_dict()) == before,
                    "training": model.training}, os.path.join(out_dir, f"eval{rank}.pt"))
    finally:
        trainer.close()


@pytest.mark.timeout(600)
@pytest.mark.parametrize("strategy", ["ddp", "diloco"])
def test_validation_is_split_by_speed_and_equals_one_rank_evaluating_everything(tmp_path, strategy):
    """A 3:1 split of the 8 validation batches (6 and 2), and both ranks get exactly the figure
    one process computes over all 8 of the shared weights: ddp's model; diloco's global weights
    (here the initial ones), not the replicas', which differ on each rank and are left as they were."""
    import torch.multiprocessing as mp

    from vpscluster.train.data import load_dataset
    from vpscluster.train.model import build_model
    from vpscluster.train.presets import get_preset

    mp.spawn(_eval_worker, args=(2, free_port(), str(tmp_path), strategy), nprocs=2, join=True)
    got = [torch.load(tmp_path / f"eval{r}.pt", weights_only=False) for r in range(2)]
    cfg, shape = _cfg(2, 4, [3.0, 1.0]), get_preset("tiny")
    model = build_model(shape, cfg.seed).eval()
    with torch.no_grad():
        losses = [model(x, y).item() for x, y in load_dataset(None, shape.seq_len, cfg.val_fraction)
                  .val_batches(cfg.eval_batches, cfg.micro_batch())]
    assert len(losses) == 8
    alone = sum(losses) / len(losses)
    assert [g["share"] for g in got] == [list(range(0, 6)), list(range(6, 8))]
    assert got[0]["val"] == got[1]["val"] == pytest.approx(alone, rel=1e-6)
    assert all(g["restored"] and g["training"] for g in got)
