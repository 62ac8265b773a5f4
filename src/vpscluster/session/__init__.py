"""vpscluster's strategies for your own PyTorch loop (the public session API).

    from vpscluster import session
    s = session.start()                         # s.rank, s.world_size, s.device
    model = s.setup(model)                      # build the optimizer from what it returns
    for x, y in s.shard(dataset, batch_size=32):    # this rank's part, new order each epoch
        loss = loss_fn(model(x), y); loss.backward()
        s.step(optimizer, samples=len(x), loss=loss)    # step + sync + metrics + stop agreement
        optimizer.zero_grad()
        if s.should_stop: break
    report = s.close()                          # final sync: identical weights on every rank

`vpscluster run [--strategy ddp|diloco] [--sync-every H] [--wire-dtype int8] ... -- python
script.py` decides the strategy and its settings; plain `python script.py` is one process with
nothing to synchronise. Checkpoints: `s.save(optimizer)` (or `checkpoint_every`) and
`s.resume(optimizer)` before the loop. Modules: config (the launcher's settings), core (the
Session), dist (joining the job), shard (the data split), balance (re-split shares), report.
The built-in `vpscluster train` is one user of this API (`train/trainer.py`).
"""

from __future__ import annotations

from vpscluster.session.config import ENV, SessionConfig

__all__ = ["ENV", "SessionConfig", "start"]


def start(backend: str = "auto", **settings):
    """Join the job `vpscluster run` started (or none: one process) and return its Session.

    `settings`: SessionConfig keys that override the launcher's (e.g. `run_dir="runs/x"`,
    `strategy={"name": "diloco", "sync_every": 8}`, `time_budget_s=60`, `resume=True`)."""
    from vpscluster.session.config import from_environment
    from vpscluster.session.core import Session

    if backend not in ("auto", "gloo", "nccl"):
        from vpscluster.errors import UserError

        raise UserError(f"session.start(backend={backend!r}): choose auto, gloo or nccl")
    cfg = from_environment(**settings)
    if cfg.threads_per_rank:  # `run --threads-per-rank N` (OMP_NUM_THREADS too) or the script's own keyword
        import torch

        torch.set_num_threads(cfg.threads_per_rank)
    s = Session(cfg, backend)
    import os

    if os.environ.get(ENV):  # started by `vpscluster run`: rank 0's few events (resume, checkpoint, stopping,
        from vpscluster.session.core import STEP_EVENT_S  # its step now and then) reach the launcher's
        from vpscluster.train.events import event_writer  # recovery (launch/supervisor.py)

        s.events = event_writer(s.rank)
        s.step_events_s = STEP_EVENT_S
    return s
