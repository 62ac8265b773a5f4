"""The built-in trainer's validation loss, on the weights every rank shares.

The mean loss over the same `eval_batches` validation batches, whoever computes them, of the
weights every rank shares (`Strategy.eval_weights`: ddp's model, DiLoCo's global weights). The
batches are split among the ranks by speed (the current shares' speeds, else evenly) and the
per-batch losses gathered and summed in batch order, so every rank gets the figure one rank would
compute alone, in a fraction of the time. (Every rank evaluating every batch made a 0.15-core node
take 4x as long as a 0.6-core one for the same figure, and the others waited for it at the next
collective.)
"""

from __future__ import annotations

from typing import Any

from vpscluster.train.shares import even, offsets, split


def evaluate(t: Any) -> float:
    """`t`: the Trainer. Logs the figure (metrics line, exporter, `eval` event) and returns it."""
    import torch

    s, cfg = t.session, t.cfg
    b = cfg.micro_batch()
    n = -(-min(cfg.eval_batches * b, t.dataset.num_val_samples) // b)  # as val_batches yields
    mine = eval_share(s, n)
    losses: dict[int, float] = {}
    with s.strategy.eval_weights() as module, torch.no_grad():
        module.eval()
        for i, (x, y) in enumerate(t.dataset.val_batches(cfg.eval_batches, b)):
            if i in mine:
                losses[i] = module(x.to(s.device), y.to(s.device)).item()
        module.train()
    if s.ctx.group is not None:
        with s.strategy.comm.timed(0):
            for part in s.all_gather_object(losses):
                losses.update(part)
        s.book_off_comm()
    val = sum(losses[i] for i in range(n)) / n
    s.metrics.log(step=s.steps, val_loss=val)
    s.exporter.val_loss(val)
    s.events.emit("eval", step=s.steps, val_loss=val)
    return val


def eval_share(s: Any, n: int) -> range:
    """This rank's validation batches: a contiguous run, sized by the ranks' speeds."""
    if s.world_size == 1:
        return range(n)
    counts = split(s.shares.speeds, n, min_share=0) if s.shares is not None else even(s.world_size, n)
    start = offsets(counts)[s.rank]
    return range(start, start + counts[s.rank])
