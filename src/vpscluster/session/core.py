"""The Session: vpscluster's strategies, metrics, stop agreement and checkpoints for a user's loop.

    s = session.start()
    model = s.setup(model)                     # the strategy's model; build the optimizer from it
    for x, y in s.shard(dataset, batch_size=32):
        loss = loss_fn(model(x), y); loss.backward()
        s.step(optimizer, samples=len(x), loss=loss)
        optimizer.zero_grad()
        if s.should_stop: break
    report = s.close()

It drives a strategy exactly as the built-in trainer does (`train/strategies/base.py`): per loop
step `tokens_processed` (here: samples), `step`, then — at the strategy's sync points only — the
one-integer stop agreement (`train/stopping.py`: the time budget and SIGTERM/SIGINT, so every
rank stops after the same step), and `comm.take()` for the step's communication; `finalize` once
in `close`. With uneven shares (`strategy.micro_batches`, diloco) a rank's micro-batches of a
step are inner steps of their own: all but the last are plain optimizer steps.

What the session does not touch: the user's loss, learning rate (diloco's replicas step with the
optimizer's lr as given), gradient clipping (do it before `step`), evaluation.
"""

from __future__ import annotations

import os
import sys
import time
from collections import deque
from pathlib import Path
from typing import Any, Callable

from vpscluster import fsutil
from vpscluster.errors import UserError
from vpscluster.session.config import SessionConfig
from vpscluster.train import checkpoint, exporter, metrics, rundir, stopping

RECENT_LOSSES = 10  # final_train_loss: the mean of rank 0's last this-many step losses


class Session:
    def __init__(self, cfg: SessionConfig, backend: str = "auto") -> None:
        import torch.distributed as dist

        from vpscluster.train.strategies import get_strategy_class
        from vpscluster.train.trainer import init_distributed

        self.cfg = cfg
        s = cfg.strategy
        self._owns_group = "MASTER_ADDR" in os.environ and not dist.is_initialized()
        if dist.is_initialized():  # the script (or a test harness) joined the job itself
            from vpscluster.train.strategies.base import DistContext

            backend = dist.get_backend()
            import torch

            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if backend == "nccl" \
                else torch.device("cpu")
            self.ctx = DistContext(rank=dist.get_rank(), world_size=dist.get_world_size(),
                                   local_rank=int(os.environ.get("LOCAL_RANK", "0")), backend=backend,
                                   device=device, group=dist.group.WORLD)
        else:
            self.ctx = init_distributed(cfg, backend)
        if s.micro_batches and s.name == "ddp":
            raise UserError("uneven shares (--micro-batches) in a session need --strategy diloco for now; "
                            "with ddp leave them out")
        # --strategy auto: DDP until the first steps are measured, then the plan's choice (session/auto.py).
        self.auto = None
        if s.name == "auto":
            import dataclasses

            from vpscluster.session.auto import AutoChoice

            if cfg.auto is None and self.ctx.world_size > 1:
                raise UserError("--strategy auto needs the cluster's link figures: start the script with "
                                "`vpscluster run --strategy auto`, or give ddp or diloco")
            s = dataclasses.replace(s, name="ddp")
            self.auto = AutoChoice()
        self.strategy = get_strategy_class(s.name, s.quorum)(s, self.ctx)
        self.shares = None
        if s.micro_batches:
            from vpscluster.train.shares import ShareController

            self.shares = ShareController.start(self.ctx.world_size, s.micro_batches, s.speeds, s.min_share,
                                                s.max_spread, balance=False)
        self.run_dir = Path(cfg.run_dir) if cfg.run_dir else None
        if self.run_dir is not None and self.rank == 0:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        self.metrics = (metrics.metrics_log(self.rank, self.run_dir / rundir.METRICS)
                        if self.run_dir is not None else metrics.NullMetricsLog())
        self.exporter = exporter.rank_exporter(cfg.exporters, self.rank, self.ctx.local_rank, os.getcwd())
        self.coll = checkpoint.Collectives(self.rank, self.world_size, self.ctx.local_rank, self._all_gather_object,
                                           self._broadcast_object if self.ctx.group is not None else None)
        self.totals = metrics.Totals()
        self.recent_losses: deque[float] = deque(maxlen=RECENT_LOSSES)
        self.steps = 0  # loop steps done (each one micro-batch per rank, or a rank's share of them)
        self.should_stop = False
        self.stopped_by: str | None = None
        self.stop_requested = False  # SIGTERM/SIGINT: acted on at the next sync point
        self.model = None
        self._plain = None  # the unwrapped model, also after close
        self._data = {"epoch": 0, "index": 0}  # Session.shard's position (session/shard.py)
        self._micro = (0, 1)  # (this micro-batch, this rank's micro-batches in the step)
        self._optimizer = None
        self._began: float | None = None  # perf_counter when the loop started (first step)
        self._mark = time.perf_counter()  # the end of the last step: the next step's time starts there
        self._start_step = 0
        self._wall_before = 0.0
        self._saved_step: int | None = None
        self._step_loss: list[float] = []
        self._step_samples = 0
        self._closed = False

    # ---- where this process sits ----------------------------------------------------------
    @property
    def rank(self) -> int:
        return self.ctx.rank

    @property
    def world_size(self) -> int:
        return self.ctx.world_size

    @property
    def local_rank(self) -> int:
        return self.ctx.local_rank

    @property
    def device(self):
        return self.ctx.device

    @property
    def is_main(self) -> bool:
        return self.ctx.rank == 0

    def _shares(self) -> list[int]:
        """Micro-batches per data shard in a step (one per rank, unless uneven shares)."""
        return list(self.shares.shares) if self.shares is not None else [1] * self.strategy.data_shard()[1]

    def _shard_index(self) -> int:
        """The data shard this rank reads: its rank (the quorum engine: its replica group's)."""
        return self.strategy.data_shard()[0]

    def _all_gather_object(self, obj: Any) -> list[Any]:
        if self.ctx.group is None:
            return [obj]
        import torch.distributed as dist

        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.ctx.group)
        return out

    def _broadcast_object(self, obj: Any, src: int) -> Any:
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=src, group=self.ctx.group)
        return box[0]

    # ---- the user's calls -----------------------------------------------------------------
    def setup(self, model):
        """The model on this rank's device, handed to the strategy (ddp: wrapped in DDP; diloco:
        the replica, every rank starting from rank 0's weights). Build the optimizer from the
        module this returns."""
        if self.model is not None:
            raise UserError("session.setup() was called twice; set up one model per session")
        self.model = self.strategy.setup(model.to(self.device))
        self._plain = self.strategy.unwrap()
        self.strategy.join(lambda: {"steps": self.steps, "data": dict(self._data)})
        self._follow()
        if self.auto is not None:  # a module whose forward follows the strategy chosen later
            from vpscluster.session.auto import Switchable

            self.model = Switchable(self._plain, self.model)
            if self.world_size <= 1:
                self._chosen({"settings": {"name": "ddp"}, "reason": "ddp: one rank, nothing to synchronise",
                              "at_step": 0, "measured": None})
        return self.model

    def _choose(self) -> None:
        """--strategy auto: every rank's measured window, gathered; the same choice everywhere."""
        from vpscluster.session import auto

        self._chosen(auto.choose(self, self._all_gather_object(self.auto.summary())))

    def _chosen(self, made: dict[str, Any]) -> None:
        from vpscluster.session import auto

        self.auto.made = made
        auto.switch(self, made)
        if self.is_main:
            print(f"strategy auto -> {made['reason']}", flush=True)

    def _follow(self) -> None:
        """A replica that healed from a peer (the quorum engine) goes on from the peer's place."""
        moved = self.strategy.moved_to()
        if moved:
            self.steps = int(moved["steps"])
            self._data.update(moved["data"])  # in place: a running `shard` loop reads this dict

    def shard(self, dataset, batch_size: int, collate: Callable[[list], Any] | None = None):
        """This rank's batches of `dataset`, one epoch per `for` (session/shard.py)."""
        from vpscluster.session.shard import ShardLoader

        return ShardLoader(self, dataset, batch_size, collate)

    def unwrap(self):
        """The plain model (not the DDP wrapper): the one saved, hashed and evaluated."""
        self._need_model()
        return self._plain

    def _need_model(self) -> None:
        if self._plain is None:
            raise UserError("call session.setup(model) first")

    def _request_stop(self, signum, _frame) -> None:
        self.stop_requested = True

    def _begin(self) -> None:
        from vpscluster.train.trainer import end_startup

        self._need_model()
        end_startup(self.ctx, self.cfg.timeouts.train_collective_s, self.strategy.collective_groups())
        stopping.install_handler(self._request_stop)
        self._vote = stopping.StopVote(self.steps)
        self._start_step = self.steps
        self._wall_before = self.totals.wall_seconds
        self._began = self._mark = time.perf_counter()
        self.exporter.start_outer_count(getattr(self.strategy, "outer_steps", None))

    def step(self, optimizer, samples: int | None = None, loss: Any = None) -> None:
        """The optimizer step, the strategy's sync when due, this step's metrics and, at sync
        points, the stop agreement (`should_stop`). Call it after `loss.backward()`, once per
        batch; `samples`: the batch's size (weighs diloco's average; counted in the report)."""
        if self._began is None:
            self._begin()
        if self._closed:
            raise UserError("session.step() after session.close()")
        self._optimizer = optimizer
        n = int(samples) if samples is not None else 0
        self._step_samples += n
        if loss is not None:
            self._step_loss.append(float(loss.detach()) if hasattr(loss, "detach") else float(loss))
        strategy = self.strategy
        strategy.tokens_processed(n)  # before step: an outer sync in it weighs by them
        i, count = self._micro
        if i < count - 1:  # diloco's uneven shares: an inner step of its own
            optimizer.step()
            return
        self.steps += 1
        strategy.step(optimizer, self.steps)
        self._follow()
        if strategy.is_sync_point(self.steps):  # ddp: every step; diloco: where an outer update lands
            budget = self.cfg.time_budget_s
            over = budget is not None and self._vote.budget_spent(self.steps, time.perf_counter() - self._began, budget)
            code = stopping.agree(stopping.STOP_REQUESTED if self.stop_requested else int(over), self.ctx, strategy.comm)
            if code:
                self.should_stop, self.stopped_by = True, stopping.STOPPED_BY[code]
        comm_s, nbytes = strategy.comm.take()
        now = time.perf_counter()
        step_s, self._mark = now - self._mark, now
        self.totals.add_step(self._step_samples, step_s, comm_s, nbytes)
        self.totals.wall_seconds = self._wall_before + (now - self._began)
        loss_value = sum(self._step_loss) / len(self._step_loss) if self._step_loss else None
        if loss_value is not None:
            self.recent_losses.append(loss_value)
        self.metrics.log(step=self.steps, loss=loss_value, step_seconds=step_s,
                         compute_seconds=max(0.0, step_s - comm_s), comm_seconds=comm_s,
                         samples=self._step_samples, bytes_sent=nbytes)
        self.exporter.step(self.steps, loss_value, self._step_samples, self._step_samples, step_s, comm_s, nbytes,
                           getattr(strategy, "outer_steps", None))
        self._step_loss, self._step_samples = [], 0
        if self.auto is not None and self.auto.record(self.steps, max(0.0, step_s - comm_s), comm_s, nbytes):
            self._choose()  # from the next step on, the chosen strategy
        every = self.cfg.checkpoint_every
        if every and self.run_dir is not None and self.steps % every == 0 and not self.should_stop:
            self.save(optimizer)

    # ---- checkpoints ----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The session's own state: the strategy's (diloco: global weights, outer momentum,
        syncs in flight), the data position, shares, counters and torch's RNG."""
        import torch

        rng = {"torch": torch.get_rng_state()}
        if self.device.type == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state(self.device)
        return {"strategy": self.strategy.state_dict(), "data": dict(self._data), "steps": self.steps,
                "totals": self.totals.to_dict(), "recent_losses": list(self.recent_losses), "rng": rng,
                "shares": self.shares.state_dict() if self.shares is not None else None,
                "auto": self.auto.made if self.auto is not None else None}

    def load_state_dict(self, state: dict[str, Any], recut: bool = False) -> None:
        import torch

        if self.auto is not None and self.auto.made is None and state.get("auto"):
            self._chosen(state["auto"])  # the checkpoint's strategy, as chosen before it was saved
        s = state["strategy"]
        self.strategy.load_state_dict(self.strategy.reshard_state(s) if recut else s)
        self._data = {"epoch": int(state["data"]["epoch"]), "index": int(state["data"]["index"])}
        self.steps = int(state["steps"])
        self.totals = metrics.Totals.from_dict(state["totals"])
        self.recent_losses.clear()
        self.recent_losses.extend(state["recent_losses"])
        torch.set_rng_state(state["rng"]["torch"])
        if "cuda" in state["rng"] and self.device.type == "cuda":
            torch.cuda.set_rng_state(state["rng"]["cuda"], self.device)
        if self.shares is not None and state.get("shares") is not None and not recut:
            self.shares.load_state_dict(state["shares"])

    def _checkpoints(self) -> Path:
        if self.run_dir is None:
            raise UserError("checkpoints need a run dir: start the script with `vpscluster run`, "
                            "or pass session.start(run_dir=...)")
        return self.run_dir / rundir.CHECKPOINTS

    def save(self, optimizer, extra: dict[str, Any] | None = None) -> Path | None:
        """A checkpoint of this step on every rank (collective): the model, `optimizer`, the
        session's state and `extra` (anything of the script's: plain values and tensors). A full
        disk keeps the previous checkpoint and returns None (training goes on)."""
        self._need_model()
        payload = {"model": self.unwrap().state_dict(), "optimizer": optimizer.state_dict(),
                   "session": self.state_dict(), "extra": extra}
        try:
            d = checkpoint.save(self._checkpoints(), self.steps, payload, self.coll, self.cfg.keep_checkpoints)
        except checkpoint.CheckpointFailed as e:
            if self.is_main:
                print(f"warning: {e}; training goes on, the previous checkpoint is intact", file=sys.stderr, flush=True)
            return None
        self._saved_step = self.steps
        return d

    def resume(self, optimizer) -> dict[str, Any] | None:
        """Continue from the newest checkpoint in the run dir valid on every rank (collective;
        after `setup` and building `optimizer`, before the loop). Returns the checkpoint's
        `extra` ({} when it had none), or None when there is nothing to resume from. Does
        nothing (None) unless the run resumes (`vpscluster run --resume`, start(resume=True))."""
        self._need_model()
        if not self.cfg.resume:
            return None
        point = checkpoint.find_and_load(self._checkpoints(), self.coll)
        if point.step is None:
            return None
        p = point.payload
        self.unwrap().load_state_dict(p["model"])
        optimizer.load_state_dict(p["optimizer"])
        self.load_state_dict(p["session"], recut=point.recut)  # after the model: diloco may hold local weights
        self._saved_step = self.steps
        return p.get("extra") or {}

    # ---- the end --------------------------------------------------------------------------
    def close(self) -> dict[str, Any]:
        """The final sync (diloco: a last outer step mid-round), so every rank ends with the same
        weights; a last checkpoint when checkpoints are on; the report (written to the run
        dir's report.json by rank 0), returned on every rank. Then the process group goes."""
        if self._closed:
            raise UserError("session.close() was called twice")
        self._need_model()
        if self._began is None:
            self._begin()
        t0 = time.perf_counter()
        self.strategy.finalize(self.steps)
        final_s, final_bytes = self.strategy.comm.take()
        self.totals.comm_seconds += final_s
        self.totals.bytes_sent += final_bytes
        self.exporter.communicated(final_bytes)
        self.totals.wall_seconds += time.perf_counter() - t0
        if self.run_dir is not None and self._optimizer is not None and self._saved_step != self.steps \
                and (self.cfg.checkpoint_every or self.stopped_by == "stop_requested"):
            self.save(self._optimizer)
        from vpscluster.session.report import build_report

        report = build_report(self)
        if self.run_dir is not None and self.is_main:
            fsutil.write_json(self.run_dir / rundir.REPORT, report)
        self._closed = True
        self._shutdown()
        return report

    def _shutdown(self) -> None:
        import gc

        import torch.distributed as dist

        self.strategy.close()
        self.metrics.close()
        self.exporter.close()
        # Whatever holds the process group (DDP's reducer) goes before the group (as the trainer does).
        self.model = None
        self.strategy.__dict__.pop("_ddp", None)
        gc.collect()
        if self._owns_group and dist.is_initialized():
            dist.destroy_process_group()
