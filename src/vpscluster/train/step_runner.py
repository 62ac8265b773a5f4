"""One loop step of the built-in trainer, on the session (`Session.step`): even or shared.

Both run the forward and backward passes, clip the gradients by global norm after they are
synchronised (the same on all ranks) and hand the optimizer step, the sync, the stop agreement and
the step's metrics to the session. Each returns the metrics line's own fields (lr, the global
step's tokens, shares), which the loop's `step` event repeats. The caller zeroes the gradients.

- `even`: one micro-batch per rank (the rank's `ShardSampler` shard).
- `shared`: this rank's share of the step's micro-batches of one global stream (`train/shares.py`).
  ddp: each micro-batch's loss is scaled by world/total before backward and DDP averages over the
  world, so the gradient is the mean over the whole global batch — the even split's gradient —
  whatever the shares. All but the last backward run under no_sync; a rank with no micro-batch
  runs an empty batch (zero gradients) so it joins the all-reduce. diloco: every micro-batch is an
  inner step of its own (a faster rank does more per round); tokens are counted per micro-batch,
  so the outer average is weighted by them.
"""

from __future__ import annotations

from typing import Any


def _clip(t: Any) -> None:
    import torch

    torch.nn.utils.clip_grad_norm_(t.strategy.unwrap().parameters(), t.cfg.grad_clip)


def even(t: Any, started: float, lr: float) -> dict[str, Any]:
    """`t`: the Trainer; `started`: perf_counter at the step's start; `lr`: the step's."""
    s, device = t.session, t.ctx.device
    x, y = t.sampler.next_batch()
    loss = t.model(x.to(device), y.to(device))
    loss.backward()
    _clip(t)
    log = {"lr": lr, "tokens": t.micro_tokens * t.global_micro}
    s.step(t.optimizer, samples=t.micro_tokens, loss=loss, inner=False, started=started, log=log)
    return log


def shared(t: Any, started: float, lr: float) -> tuple[dict[str, Any], float | None, int]:
    """As `even`, for this rank's share; also returns its micro-batches' mean loss (None: it ran
    none) and how many it ran."""
    import torch

    s, device, opt, strategy = t.session, t.ctx.device, t.optimizer, t.strategy
    batches = t.sampler.next_step(s.shares.shares, s.rank)
    n = len(batches)
    log = {"lr": lr, "tokens": t.micro_tokens * t.global_micro, "shares": list(s.shares.shares)}
    losses = []
    if strategy.micro_batches_are_steps:
        for i, (x, y) in enumerate(batches):
            loss = t.model(x.to(device), y.to(device))
            loss.backward()
            _clip(t)
            losses.append(loss.detach())
            if i < n - 1:
                s.step(opt, samples=t.micro_tokens, inner=True)
                opt.zero_grad(set_to_none=True)
        samples = t.micro_tokens if n else 0  # the last micro-batch's (a rank without any: none)
    else:
        scale = t.ctx.world_size / t.cfg.strategy.micro_batches
        if n == 0:
            empty = torch.zeros((0, t.shape.seq_len), dtype=torch.long, device=device)
            (t.model(empty).sum() * 0.0).backward()
        for i, (x, y) in enumerate(batches):
            with strategy.no_sync(i < n - 1):
                loss = t.model(x.to(device), y.to(device))
                (loss * scale).backward()
            losses.append(loss.detach())
        _clip(t)
        samples = n * t.micro_tokens
    mean = torch.stack(losses).mean().item() if losses else None
    s.step(opt, samples=samples, loss=mean, inner=False, started=started, log=log)
    return log, mean, n
