"""The Session: vpscluster's strategies, metrics, stop agreement and checkpoints for a training loop.

    s = session.start()
    model = s.setup(model)                     # the strategy's model; build the optimizer from it
    for x, y in s.shard(dataset, batch_size=32):
        loss = loss_fn(model(x), y); loss.backward()
        s.step(optimizer, samples=len(x), loss=loss)
        optimizer.zero_grad()
        if s.should_stop: break
    report = s.close()

A user's script and the built-in trainer (`train/trainer.py`, the GPT on top of this API) drive
the strategy through it alike (`train/strategies/base.py`): per loop step `tokens_processed`
(samples, or tokens), `step`, then — at the strategy's sync points only — the one-integer stop
agreement (`train/stopping.py`: the time budget and SIGTERM/SIGINT, so every rank stops after the
same step), and `comm.take()` for the step's communication; `finalize` once at the end. With
uneven shares (`strategy.micro_batches`) a rank's micro-batches of a step are, for diloco, inner
steps of their own (all but the last are plain optimizer steps), and for ddp one batch whose size
follows the rank's share, its gradient weighted by that size (`weighted`, `session/shard.py`,
`DDPStrategy.weigh_batch`); with `strategy.balance` the
shares are re-split from the measured speeds (`session/balance.py`).

Checkpoints (`save`, `resume`) hold the model, the optimizer, the strategy's state (diloco:
global weights, outer momentum, syncs in flight), the data position, shares, counters and
torch's RNG; before each one the ranks compare their replicated state (`check_replicas`).

What the session does not touch: the loss, the learning rate (diloco's replicas step with the
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
from vpscluster.train import checkpoint, events, exporter, metrics, rundir, stopping

RECENT_LOSSES = 10  # final_train_loss: the mean of rank 0's last this-many step losses
# A script started by `vpscluster run`: rank 0 announces its step at most this often (a `step`
# event), so the launcher's recovery record knows where the run was and when the survivors of a
# failure trained again (launch/supervisor.py); a fast loop's steps are not each a line.
STEP_EVENT_S = 0.25


class ReplicasDiverged(UserError):
    """The ranks' replicated state differs at a checkpoint (`Session.check_replicas`)."""


class Session:
    """`events`: where rank 0's progress events go (the built-in trainer: its stdout protocol,
    `train/events.py`; a user's script: nowhere)."""

    def __init__(self, cfg: SessionConfig, backend: str = "auto", events_out: Any = None) -> None:
        import torch.distributed as dist

        from vpscluster.session.dist import init_distributed, join_existing
        from vpscluster.train.shares import look_every
        from vpscluster.train.strategies import get_strategy_class

        self.cfg = cfg
        s = cfg.strategy
        self._owns_group = "MASTER_ADDR" in os.environ and not dist.is_initialized()
        if dist.is_initialized():  # the script (or a test harness) joined the job itself
            self.ctx = join_existing()
        else:
            self.ctx = init_distributed(cfg.timeouts.startup_collective_s, backend)
        self.events = events_out if events_out is not None else events.NullEventWriter()
        # `step` events at most every this many seconds (`session.start` under `vpscluster run`);
        # None: none (the built-in trainer announces its own steps).
        self.step_events_s: float | None = None
        self._step_event_at = float("-inf")
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
        if s.micro_batches:  # uneven shares of one global stream (train/shares.py)
            from vpscluster.train.shares import ShareController, rank_speeds

            speeds = s.speeds
            if speeds is None and s.launcher.node_speeds:  # the probe's figures, by the node each rank runs on
                speeds = rank_speeds(self.all_gather_object(os.environ.get("VPSC_NODE", "local")),
                                     s.launcher.node_speeds)
            self.shares = ShareController.start(self.ctx.world_size, s.micro_batches, speeds, s.min_share,
                                                s.max_spread, s.balance)
        # ddp's shares: one batch a step per rank, its size following the share, its gradient
        # weighted by it (session/shard.py); diloco's: micro-batches of the script's batch, each an inner step.
        self.weighted = self.shares is not None and not self.strategy.micro_batches_are_steps
        self._sizes: tuple[tuple[int, ...], int, list[int]] | None = None  # (shares, samples, batch sizes)
        self.window = [0.0, 0]  # compute seconds, micro-batches since the last rebalancing look
        self.look_every = look_every(s.rebalance_every, s.sync_every if self.strategy.micro_batches_are_steps else None)
        self.batch_size: int | None = None  # of one micro-batch (the rebalance event names it)
        self.run_dir = Path(cfg.run_dir) if cfg.run_dir else None
        if self.run_dir is not None and self.rank == 0:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        self.metrics = (metrics.metrics_log(self.rank, self.run_dir / rundir.METRICS)
                        if self.run_dir is not None else metrics.NullMetricsLog())
        self.exporter = exporter.rank_exporter(cfg.exporters, self.rank, self.ctx.local_rank, os.getcwd())
        self.coll = checkpoint.Collectives(self.rank, self.world_size, self.ctx.local_rank, self.all_gather_object,
                                           self._broadcast_object if self.ctx.group is not None else None)
        self.resume_hint = "--resume"  # how a user continues from the last checkpoint (ReplicasDiverged)
        self.totals = metrics.Totals()
        self.recent_losses: deque[float] = deque(maxlen=RECENT_LOSSES)
        self.steps = 0  # loop steps done (each one micro-batch per rank, or a rank's share of them)
        self.should_stop = False
        self.stopped_by: str | None = None
        self.stop_requested = False  # SIGTERM/SIGINT: acted on at the next sync point
        self.resumed_world_size: int | None = None  # the ranks of the checkpoint resumed from
        self.last_step: tuple[float, float] = (0.0, 0.0)  # the last loop step's (seconds, comm seconds)
        self.last_loss: float | None = None  # and its loss on this rank (None: it ran no micro-batch)
        self.model = None
        self._plain = None  # the unwrapped model, also after close
        # Session.shard's position (session/shard.py): the epoch, the steps started in it and the
        # first sample of the next step in the epoch's order (samples: a step's size may change)
        self._data = {"epoch": 0, "index": 0, "sample": 0}
        self._loader: Any = None  # the last `shard` loader, whose position `_settle_data` settles
        self.data: Any = None  # or a sampler of the loop's own (state_dict, load_state_dict(state, recut))
        self._micro = (0, 1)  # (this micro-batch, this rank's micro-batches in the step)
        self._optimizer = None
        self._started = False  # start-up over (`begin`)
        self._joined = False  # the strategy's `join` made (a quorum engine's first quorum)
        self._began: float | None = None  # perf_counter when the loop's clock started
        self._mark = time.perf_counter()  # the end of the last step: the next step's time starts there
        self._start_step = 0
        self._wall_before = 0.0
        self._saved_step: int | None = None
        self._step_loss: list[float] = []
        self._step_samples = 0
        self._finalized = False
        self._closed = False
        if self._owns_group:  # a script that never calls close(): its groups go before the interpreter's teardown
            import atexit

            atexit.register(self._at_exit)

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

    @property
    def epoch(self) -> int:
        """The epoch `shard`'s next batch comes from (0-based; a resumed session's, from its
        checkpoint): a script that loops over epochs starts at it, `for e in range(s.epoch, epochs)`."""
        return int(self._data["epoch"])

    @property
    def start_step(self) -> int:
        """The step this session's loop started from (a resumed checkpoint's, else 0)."""
        return self._start_step

    def _shares(self) -> list[int]:
        """Micro-batches per data shard in a step (one per rank, unless uneven shares)."""
        return list(self.shares.shares) if self.shares is not None else [1] * self.strategy.data_shard()[1]

    def _batch_sizes(self, samples: int) -> list[int]:
        """A ddp session's batch per rank this step: `samples` (world x the script's batch size)
        split by the shares (`train.shares.batch_sizes`), the same on every rank."""
        from vpscluster.train.shares import batch_sizes

        shares = tuple(self._shares())
        if self._sizes is None or self._sizes[:2] != (shares, samples):
            self._sizes = (shares, samples, batch_sizes(shares, samples))
        return self._sizes[2]

    def _weigh(self, sizes: list[int]) -> None:
        """This rank's gradient weighs world * its batch / the step's samples (`DDPStrategy._weighted`)."""
        self.strategy.weigh_batch(len(sizes) * sizes[self.rank] / sum(sizes))

    def _shard_index(self) -> int:
        """The data shard this rank reads: its rank (the quorum engine: its replica group's)."""
        return self.strategy.data_shard()[0]

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's `obj`, in rank order (collective; `[obj]` in one process)."""
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

    def book_off_comm(self) -> None:
        """A gather between steps (a rebalancing look, a checkpoint's replica check, an
        evaluation's losses) is communication of the run, booked to the totals now. Left in the
        strategy's counter, the next step would take it as its own and count that much less
        compute: after the first look, where the fast ranks wait seconds for the slowest, their
        next step showed 0 s of compute, the next window's speeds doubled, and the second look
        re-split 14:7:3 into 16:7:1 (bench uneven, 2026-12-04)."""
        seconds, nbytes = self.strategy.comm.take()
        self.totals.comm_seconds += seconds
        self.totals.bytes_sent += nbytes
        self.exporter.communicated(nbytes)

    # ---- the user's calls -----------------------------------------------------------------
    def setup(self, model):
        """The model on this rank's device, handed to the strategy (ddp: wrapped in DDP; diloco:
        the replica, every rank starting from rank 0's weights). Build the optimizer from the
        module this returns."""
        if self.model is not None:
            raise UserError("session.setup() was called twice; set up one model per session")
        self.model = self.strategy.setup(model.to(self.device))
        self._plain = self.strategy.unwrap()
        if not self.cfg.resume:  # a resumed run joins once its checkpoint is loaded (`resume`)
            self._join()
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

        self._chosen(auto.choose(self, self.all_gather_object(self.auto.summary())))

    def _chosen(self, made: dict[str, Any]) -> None:
        from vpscluster.session import auto

        self.auto.made = made
        auto.switch(self, made)
        if self.is_main:
            print(f"strategy auto -> {made['reason']}", flush=True)

    def _join(self) -> None:
        """The strategy's `join` (a quorum engine's first quorum), once the state this replica
        starts from is in place: after `setup`, or after `resume` loaded a checkpoint. Joined
        before the checkpoint was loaded, a replica was counted in its peers' first round with
        the fresh model and then, resumed, asked a quorum of its own: their round's sync timed
        out without it and it trained a round behind them, logging outer steps at their syncs'
        places with other hashes (issue #34: disagreeing sync hashes after a relaunch)."""
        if self._joined:
            return
        self._joined = True
        self.strategy.join(lambda: {"steps": self.steps, "data": dict(self._data)})
        self._follow()

    def _follow(self) -> None:
        """A replica that healed from a peer (the quorum engine) goes on from the peer's place."""
        moved = self.strategy.moved_to()
        if moved:
            self.steps = int(moved["steps"])
            self._data.update(moved["data"])  # in place: a running `shard` loop reads this dict

    def shard(self, dataset, batch_size: int, collate: Callable[[list], Any] | None = None):
        """This rank's batches of `dataset`, one epoch per `for` (session/shard.py)."""
        from vpscluster.session.shard import ShardLoader

        self.batch_size = batch_size
        self._loader = ShardLoader(self, dataset, batch_size, collate)
        return self._loader

    def _settle_data(self) -> None:
        """The step's size changed (auto's switch from ddp to diloco on shares): an epoch whose
        rest holds no step of the new size ends now, so a checkpoint of this step resumes at the
        next one (`Session.epoch`)."""
        if self._loader is not None:
            self._loader.settle()

    def unwrap(self):
        """The plain model (not the DDP wrapper): the one saved, hashed and evaluated."""
        self._need_model()
        return self._plain

    def _need_model(self) -> None:
        if self._plain is None:
            raise UserError("call session.setup(model) first")

    def _request_stop(self, signum, _frame) -> None:
        self.stop_requested = True

    def begin(self) -> None:
        """Start-up is over (the first `step` calls it): collectives get the training time-out
        (`session/dist.py: end_startup`), SIGTERM/SIGINT from now on ask for a stop at the next
        sync point (before, they end the rank: it has nothing to save), the loop's clock starts."""
        if self._started:
            return
        from vpscluster.session.dist import end_startup

        self._need_model()
        self._join()  # a run resuming whose loop never called `resume` joins here
        self._started = True
        end_startup(self.ctx, self.cfg.timeouts.train_collective_s, self.strategy.collective_groups())
        stopping.install_handler(self._request_stop)
        self._start_step = self.steps
        self.exporter.start_outer_count(getattr(self.strategy, "outer_steps", None))
        self.start_clock()

    def start_clock(self) -> None:
        """The loop's time (the report's wall seconds, the time budget) counts from now (the
        trainer starts it after its first evaluation)."""
        self._vote = stopping.StopVote(self.steps)
        self._wall_before = self.totals.wall_seconds
        self._began = self._mark = time.perf_counter()

    def step(self, optimizer, samples: int | None = None, loss: Any = None, *, inner: bool | None = None,
             started: float | None = None, log: dict[str, Any] | None = None) -> None:
        """The optimizer step, the strategy's sync when due, this step's metrics and, at sync
        points, the stop agreement (`should_stop`). Call it after `loss.backward()`, once per
        batch; `samples`: the batch's size (weighs diloco's average; counted in the report).

        For loops that count their own way (the built-in trainer): `inner` — this micro-batch is
        one of the rank's share but not its last (default: as `shard` yields them); `started` —
        perf_counter when the step began (default: the end of the last one); `log` — the
        metrics line's own fields instead of `samples` (the trainer's lr, global tokens, shares)."""
        if not self._started:
            self.begin()
        if self._closed:
            raise UserError("session.step() after session.close()")
        self._optimizer = optimizer
        n = int(samples) if samples is not None else 0
        self._step_samples += n
        if loss is not None:
            self._step_loss.append(float(loss.detach()) if hasattr(loss, "detach") else float(loss))
        strategy = self.strategy
        strategy.tokens_processed(n)  # before step: an outer sync in it weighs by them
        if inner is None:
            i, count = self._micro
            inner = i < count - 1
        if inner:  # diloco's uneven shares: an inner step of its own
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
            elif strategy.left():  # drained (a quorum engine): its last sync done, the others go on
                self.should_stop, self.stopped_by = True, "drained"
                self.events.emit("drained", step=self.steps)
        self._record(started, log)
        every = self.cfg.checkpoint_every
        if every and self.run_dir is not None and self.steps % every == 0 and not self.should_stop:
            self.save(optimizer)

    def _record(self, started: float | None, log: dict[str, Any] | None) -> None:
        """The step's communication, totals, metrics line and exporter figures; the shares' window."""
        comm_s, nbytes = self.strategy.comm.take()
        now = time.perf_counter()
        step_s = now - (started if started is not None else self._mark)
        self._mark = now
        samples = self._step_samples
        self.totals.add_step(samples, step_s, comm_s, nbytes)
        self.totals.wall_seconds = self._wall_before + (now - self._began)
        loss_value = sum(self._step_loss) / len(self._step_loss) if self._step_loss else None
        if loss_value is not None:  # None: this rank ran no micro-batch this step
            self.recent_losses.append(loss_value)
        own = dict(log) if log is not None else {"samples": samples}  # the units counted: samples, or the caller's
        if log is None and self.shares is not None:  # a user's loop on shares: the split it ran
            own["shares"] = list(self.shares.shares)
            if self.weighted and self._sizes is not None:
                own["batch_sizes"] = list(self._sizes[2])
        lr = {"lr": own.pop("lr")} if "lr" in own else {}
        units = {k: own.pop(k) for k in ("samples", "tokens") if k in own}
        self.metrics.log(step=self.steps, loss=loss_value, **lr, step_seconds=step_s,
                         compute_seconds=max(0.0, step_s - comm_s), comm_seconds=comm_s, **units, bytes_sent=nbytes,
                         **own)
        self.exporter.step(self.steps, loss_value, (log or {}).get("tokens", samples), samples, step_s, comm_s,
                           nbytes, getattr(self.strategy, "outer_steps", None))
        self.last_step, self.last_loss = (step_s, comm_s), loss_value
        self._step_loss, self._step_samples = [], 0
        if self.step_events_s is not None and now - self._step_event_at >= self.step_events_s:
            self._step_event_at = now
            self.events.emit("step", step=self.steps, loss=loss_value)
        if self.shares is not None:  # before auto's choice: the step ran on the shares it measures
            from vpscluster.session.balance import after_step

            after_step(self, step_s - comm_s)
        if self.auto is not None and self.auto.record(self.steps, max(0.0, step_s - comm_s), comm_s, nbytes):
            self._choose()  # from the next step on, the chosen strategy (and its shares)

    # ---- checkpoints ----------------------------------------------------------------------
    def check_replicas(self) -> None:
        """Every rank holds the same replicated state (`Strategy.replica_sha256`: ddp's weights,
        diloco's global weights and momentum): one sha256 per rank, all-gathered. Run before
        every checkpoint, so a checkpoint never holds replicas that differ.

        On a mismatch the run stops (ReplicasDiverged, a `replicas_diverged` event) and this
        checkpoint is not written: the previous one was compared alike, so a resume (or the
        recovery loop, with --max-restarts) goes on from replicas that agree. Restoring in place
        would repeat what a resume does (every rank's model, optimizer, data and strategy state)
        with less checking, and going on would train and save replicas that have parted ways."""
        if self.ctx.group is None:
            return
        with self.strategy.comm.timed(0):  # a control message, uncounted like eval's and the shares' gathers
            digests = self.all_gather_object(self.strategy.replica_sha256())
        self.book_off_comm()
        if len(set(digests)) == 1:
            return
        self.events.emit("replicas_diverged", step=self.steps, sha256=digests)
        by_digest: dict[str, list[int]] = {}
        for rank, d in enumerate(digests):
            by_digest.setdefault(d, []).append(rank)
        parts = "; ".join(f"ranks {', '.join(map(str, r))}: {d[:12]}" for d, r in by_digest.items())
        raise ReplicasDiverged(
            f"step {self.steps}: the replicas differ across ranks ({parts}); the checkpoint of this step is not "
            f"written and the run stops: continue from the last checkpoint with {self.resume_hint}")

    def _checkpoints(self) -> Path:
        if self.run_dir is None:
            raise UserError("checkpoints need a run dir: start the script with `vpscluster run`, "
                            "or pass session.start(run_dir=...)")
        return self.run_dir / rundir.CHECKPOINTS

    def _payload(self, optimizer, extra: dict[str, Any] | None) -> dict[str, Any]:
        import torch

        rng = {"torch": torch.get_rng_state()}
        if self.device.type == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state(self.device)
        payload = {
            "model": self.unwrap().state_dict(),
            "optimizer": optimizer.state_dict(),
            "strategy": self.strategy.state_dict(),
            "sampler": self.data.state_dict() if self.data is not None else dict(self._data),
            "rng": rng,
            "totals": self.totals.to_dict(),
            "recent_losses": list(self.recent_losses),
            "shares": self.shares.state_dict() if self.shares is not None else None,
            "share_window": list(self.window),
            "auto": self.auto.made if self.auto is not None else None,  # --strategy auto's choice
        }
        if extra is not None:
            payload["extra"] = extra
        return payload

    def save(self, optimizer, extra: dict[str, Any] | None = None) -> Path | None:
        """A checkpoint of this step on every rank (collective): the model, `optimizer`, the
        session's state and `extra` (anything of the script's: plain values and tensors). A full
        disk keeps the previous checkpoint and returns None (training goes on)."""
        self._need_model()
        root = self._checkpoints()
        self.check_replicas()
        t0 = time.perf_counter()
        try:
            d = checkpoint.save(root, self.steps, self._payload(optimizer, extra), self.coll, self.cfg.keep_checkpoints)
        except checkpoint.CheckpointFailed as e:  # a full disk: keep training, the previous checkpoint stands
            self.events.emit("checkpoint_failed", step=self.steps, reason=str(e))
            if self.is_main:
                print(f"warning: {e}; training goes on, the previous checkpoint is intact", file=sys.stderr, flush=True)
            return None
        self.exporter.checkpoint(time.perf_counter() - t0)
        self.events.emit("checkpoint", step=self.steps, path=str(d))
        self._saved_step = self.steps
        return d

    def resume(self, optimizer) -> dict[str, Any] | None:
        """Continue from the newest checkpoint in the run dir valid on every rank (collective;
        after `setup` and building `optimizer`, before the loop). Returns the checkpoint's
        `extra` ({} when it had none), or None when there is nothing to resume from. Does
        nothing (None) unless the run resumes (`vpscluster run --resume`, start(resume=True))."""
        import torch

        self._need_model()
        if not self.cfg.resume:
            return None
        point = checkpoint.find_and_load(self._checkpoints(), self.coll)
        if point.step is None:
            self.events.emit("resume", step=0, skipped=point.skipped)
            self._join()
            return None
        p = point.payload
        recut = point.recut  # the same on every rank: rank-local state is adapted alike
        if self.auto is not None and self.auto.made is None and p.get("auto"):
            self._chosen(p["auto"])  # the checkpoint's strategy, as chosen before it was saved
        self.unwrap().load_state_dict(p["model"])
        optimizer.load_state_dict(p["optimizer"])
        # After the model: diloco may hold local weights.
        self.strategy.load_state_dict(self.strategy.reshard_state(p["strategy"]) if recut else p["strategy"])
        if self.data is not None:
            self.data.load_state_dict(p["sampler"], recut=recut)
        else:
            self._data = {k: int(v) for k, v in p["sampler"].items() if k in ("epoch", "index", "sample")}
        torch.set_rng_state(p["rng"]["torch"])
        if "cuda" in p["rng"] and self.device.type == "cuda":
            torch.cuda.set_rng_state(p["rng"]["cuda"], self.device)
        self.totals = metrics.Totals.from_dict(p["totals"])
        self.recent_losses.clear()
        self.recent_losses.extend(p["recent_losses"])
        if self.shares is not None and p.get("shares") is not None and not recut:
            self.shares.load_state_dict(p["shares"])  # another world starts from its own shares
            self.window = list(p.get("share_window", [0.0, 0]))
        self.steps = self._saved_step = point.step
        self.resumed_world_size = point.world_size
        if self.is_main:
            metrics.truncate_after(self.run_dir / rundir.METRICS, self.steps)
        self.events.emit("resume", step=self.steps, skipped=point.skipped, world_size=self.world_size,
                         checkpoint_world_size=point.world_size, shard=point.shard, received=point.received)
        self._join()  # a replica behind its peers' outer step heals from one of them here
        return p.get("extra") or {}

    # ---- the end --------------------------------------------------------------------------
    def finalize(self) -> None:
        """The final sync (diloco: a last outer step mid-round), so every rank ends with the same
        weights; its time and bytes count as communication. Once; `close` calls it."""
        if self._finalized:
            return
        self._need_model()
        if not self._started:
            self.begin()
        t0 = time.perf_counter()
        if self.stopped_by == "stop_requested":  # a stuck peer must not hold the stop past its grace
            from vpscluster.session.dist import end_startup

            t = self.cfg.timeouts
            end_startup(self.ctx, min(t.train_collective_s, t.stop_grace_s), self.strategy.collective_groups())
            self.events.emit("stopping", step=self.steps)
        self.strategy.finalize(self.steps)
        final_s, final_bytes = self.strategy.comm.take()
        self.totals.comm_seconds += final_s
        self.totals.bytes_sent += final_bytes
        self.exporter.communicated(final_bytes)
        self.totals.wall_seconds += time.perf_counter() - t0
        self._finalized = True

    def close(self) -> dict[str, Any]:
        """The final sync (`finalize`); a last checkpoint when checkpoints are on; the report
        (written to the run dir's report.json by rank 0), returned on every rank. Then the
        process group goes."""
        if self._closed:
            raise UserError("session.close() was called twice")
        self.finalize()
        if self.run_dir is not None and self._optimizer is not None and self._saved_step != self.steps \
                and (self.cfg.checkpoint_every or self.stopped_by == "stop_requested"):
            self.save(self._optimizer)
        from vpscluster.session.report import build_report

        report = build_report(self)
        if self.run_dir is not None and self.is_main:
            fsutil.write_json(self.run_dir / rundir.REPORT, report)
        self._closed = True
        self.shutdown()
        return report

    def _at_exit(self) -> None:
        """atexit: `shutdown` for a script that ended without `close` (no final sync, no report),
        so its process groups are destroyed and freed while the interpreter is whole
        (`session/dist.py: release_groups`)."""
        if self._closed:
            return
        try:
            self.shutdown()
        except Exception as e:  # the exit goes on; one line, not a traceback
            print(f"vpscluster: the session's shutdown at exit failed: {type(e).__name__}: {e}", file=sys.stderr,
                  flush=True)

    def shutdown(self) -> None:
        """The strategy's threads, the metrics file and the exporter closed; the process group
        destroyed when this session made it. Whatever holds the group (DDP's reducer) goes first:
        destroyed under it, the process can abort at exit. `close` calls it; a loop that ends
        another way (the trainer's, or on an error) calls it itself."""
        import gc

        import torch.distributed as dist

        import atexit

        atexit.unregister(self._at_exit)
        self._closed = True
        self.strategy.close()
        self.metrics.close()
        self.exporter.close()
        self.model = None
        self.strategy.__dict__.pop("_ddp", None)
        gc.collect()
        if self._owns_group and dist.is_initialized():
            dist.destroy_process_group()
        if self._owns_group:  # the destroyed groups' backends freed now, their threads joined (release_groups)
            from vpscluster.session.dist import release_groups

            release_groups(self.ctx, self.strategy, self)
            gc.collect()
