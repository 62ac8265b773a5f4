"""DiLoCo on a quorum of replica groups: the survivors go on, a returning or new replica heals from a peer.

The engine is torchft's Manager (pytorch/torchft 0.2.0; the per-step quorum of "torchft: a
fault-tolerant training library", and its `local_sgd.DiLoCo`). Each replica group (one node; in
a local test one process) has a Manager that heartbeats to a lighthouse on the head
(`launch/lighthouse.py`) and a reconfigurable gloo process group. A round of H inner steps is:

    quorum   (first step of the round)   the lighthouse lists the replica groups present; the
             process group is rebuilt when that list changed; a replica whose outer-step count
             is behind the others' (new, returning, or one that missed a commit) first loads a
             peer's state over torchft's checkpoint transport (HTTP): θ_global, the outer
             momentum, the outer-step counts, and the loop's position (`join`)
    H inner steps
    sync     (step ≡ 0 mod H)   the token-weighted pseudo-gradient reduced over the quorum's
             process group on vpscluster's wire (`DiLoCoStrategy._reduce`: fp32, bf16 or int8,
             summed in fp32), then `should_commit`: the outer update lands only where the
             reduction succeeded; otherwise the round is skipped (its steps and tokens ride on
             the next sync, as `diloco.py` does after a failed sync)

A replica killed mid-round breaks the others' next reduction (its sockets close) or, if it is
stopped, times it out (`sync_timeout_s`, else `quorum_timeout_s`); they skip that one sync and
the next quorum leaves it out once its heartbeats stop (the lighthouse's `heartbeat_timeout_ms`):
no relaunch, no checkpoint reloaded. Agreement across replicas is torchft's: commits are decided
per replica group, and a replica that committed less than the others heals from one of them at
the next quorum, so every outer step's θ_global is the same on every replica that holds it
(`sync_hashes` lines, compared by the tests).

What carries over from `diloco.py`: the wire dtypes (dense), token weights, the outer Nesterov
step and its warm-up, sync hashes, checkpoints of the same state. Not (yet): overlap (syncs are
blocking: τ = 0), streaming fragments, sparse wires (their error-feedback residual is per
replica), uneven shares, and more than one process per replica group. A replica that joins
starts its inner optimizer afresh (its state is not sent).

The lighthouse's failure: the replicas finish the round they are in (a reduction and a commit
need no lighthouse), and the next quorum fails after `quorum_timeout_s` with one line naming the
lighthouse; the process exits non-zero and the launcher's relaunch path (`--max-restarts`) takes
over (`launch/lighthouse.py` says why a restarted lighthouse does not rescue the running job).

Draining (a node removed from the cluster file of a running job: launch/grow.py): the launcher
creates the file named by `VPSC_DRAIN_FILE` (in the node's run dir, over SSH; the replica looks
for it after every inner step: one stat). The replica then finishes the round it is in, takes
part in that round's outer sync (its pseudo-gradient counts: no round is lost) and leaves: the
loop stops (`left`, the session's `stopped_by: "drained"`), it prints `DRAINED` with the step,
and the process exits 0. So that the others' next quorum does not wait for it, it stops
heartbeating to the lighthouse (its ManagerServer shut down) as soon as it knows that round is
its last: the lighthouse counts a replica as present until `heartbeat_timeout_ms` after its last
heartbeat (`VPSC_HEARTBEAT_TIMEOUT_MS`), and a quorum waits for every present one. The sync
itself needs no ManagerServer (the reduction runs on the round's process group; `should_commit`
of a group of one is its own reduction's outcome). Where less than 1.25 times that time-out is
left of the round when the request is seen (the median of its last inner steps' times the steps
left), it stops heartbeating right after the next round's quorum and leaves at that round's end.

Where things come from (set by the launcher, or by hand for local processes):
`TORCHFT_LIGHTHOUSE` (torchft's own variable: http://HOST:PORT), `VPSC_REPLICA_GROUP`
("INDEX/COUNT": this group's data shard of COUNT, and its id) and `VPSC_REPLICA_ADDR` (where
peers reach this group's store, manager and checkpoint server; default 127.0.0.1).
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from vpscluster.errors import UserError
from vpscluster.train.strategies.base import DistContext
from vpscluster.train.strategies.diloco import DiLoCoStrategy

if TYPE_CHECKING:
    import torch
    from torch import nn

    from vpscluster.train.config import StrategyConfig

LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"
REPLICA_ENV = "VPSC_REPLICA_GROUP"
ADDRESS_ENV = "VPSC_REPLICA_ADDR"
DRAIN_ENV = "VPSC_DRAIN_FILE"  # its existence asks this replica group to leave at a sync
HEARTBEAT_ENV = "VPSC_HEARTBEAT_TIMEOUT_MS"  # the lighthouse's: how long a silent replica still counts
DRAINED = "drained at step "  # "replica group I: drained at step N ...": the launcher reads N


def drained_step(line: str) -> int | None:
    """The step of a `DRAINED` line (the replica left the quorum after it), else None."""
    import re

    m = re.search(r"replica group \d+: " + DRAINED + r"(\d+):", line)
    return int(m.group(1)) if m else None


class QuorumLost(RuntimeError):
    """No quorum formed in time: the lighthouse is gone or too few replica groups remain."""


@dataclass
class ReplicaGroup:
    index: int  # this group's data shard and id
    count: int  # the replica groups the job was planned with (data shards)
    lighthouse: str
    address: str = "127.0.0.1"
    drain_file: str | None = None  # exists: leave at a sync (the launcher's drain)
    heartbeat_timeout_s: float = 2.0  # the lighthouse's (launch/quorum.py QuorumPlan)

    @property
    def replica_id(self) -> str:
        return f"vpsc_replica_{self.index}"  # torchft reads the trailing digits

    @classmethod
    def from_environment(cls) -> "ReplicaGroup":
        lighthouse, group = os.environ.get(LIGHTHOUSE_ENV), os.environ.get(REPLICA_ENV, "")
        if not lighthouse:
            raise UserError(f"strategy.quorum needs the lighthouse's address in {LIGHTHOUSE_ENV} (http://HOST:PORT); "
                            "start the run with `vpscluster train --quorum --cluster FILE` (the built-in trainer) or "
                            "`vpscluster run --cluster FILE --strategy diloco --quorum -- python script.py` (a script "
                            "on the session API), or start a lighthouse and set it")
        try:
            index, count = (int(x) for x in group.split("/"))
            if not 0 <= index < count:
                raise ValueError
        except ValueError:
            raise UserError(f"{REPLICA_ENV}={group!r}: give INDEX/COUNT (this replica group's number and how many "
                            "there are, e.g. 0/3)") from None
        try:
            heartbeat_s = int(os.environ.get(HEARTBEAT_ENV) or 2000) / 1000
        except ValueError:
            raise UserError(f"{HEARTBEAT_ENV}={os.environ.get(HEARTBEAT_ENV)!r}: give the lighthouse's "
                            "heartbeat time-out in milliseconds (e.g. 2000)") from None
        return cls(index, count, lighthouse, os.environ.get(ADDRESS_ENV) or "127.0.0.1",
                   os.environ.get(DRAIN_ENV) or None, heartbeat_s)


def checkpoint_transport(address: str, timeout_s: float):
    """torchft's HTTP checkpoint transport, advertising `address`: torchft 0.2.0 advertises
    socket.gethostname(), which a peer may not resolve (a sandbox node, a VPS without DNS)."""
    from datetime import timedelta

    from torchft.checkpointing.http_transport import HTTPTransport

    class Transport(HTTPTransport):
        def address(self) -> str:
            return f"http://{address}:{self._server.socket.getsockname()[1]}/checkpoint/"

    return Transport(timeout=timedelta(seconds=timeout_s), num_chunks=0)


def require_torchft() -> None:
    try:
        import torchft  # noqa: F401
    except ImportError:
        raise UserError("strategy.quorum needs torchft: pip install 'torchft==0.2.0'") from None


class QuorumDiLoCoStrategy(DiLoCoStrategy):
    name = "diloco"  # DiLoCo's settings and rules; `strategy.quorum` picks this engine

    def __init__(self, config: "StrategyConfig", ctx: DistContext) -> None:
        if ctx.world_size != 1:
            raise UserError("strategy.quorum runs one process per replica group (node) for now; "
                            "start it with --nproc-per-node 1")
        require_torchft()
        super().__init__(config, ctx)
        self.overlap = 0  # blocking syncs (the module's docstring says why)
        self.replica = ReplicaGroup.from_environment()
        self.timeout_s = config.sync_timeout_s or config.quorum_timeout_s
        self.manager = None
        self.pg = None
        self._position: Callable[[], dict] | None = None
        self._completed = 0  # the loop's steps done when this round's quorum formed (what a joiner takes)
        self._round_open = False
        self._moved: dict[str, Any] | None = None  # the loop's place taken from a peer, until `moved_to`
        self._healing = False  # load_state_dict called by a heal, not by a resume
        self.quorums = 0
        self.heals = 0
        self.quorum_wait_seconds = 0.0
        self.participants_seen: list[int] = []
        # Draining: None, "next" (leave at the end of the next round), "this" (heartbeats stopped:
        # this round's sync is the last), "left" (done).
        self._drain: str | None = None
        self._stepped_at: float | None = None  # perf_counter at the end of the last step
        self._inner_s: list[float] = []  # the last inner steps' seconds (no quorum, no sync in them)
        self.drained_at: int | None = None

    # -- set-up -------------------------------------------------------------------------------

    def setup(self, model: "nn.Module") -> "nn.Module":
        from datetime import timedelta

        from torch.distributed import TCPStore
        from torchft import Manager, ProcessGroupGloo

        model = super().setup(model)  # one process per group: no collective here
        r, timeout = self.replica, timedelta(seconds=self.timeout_s)
        quorum_timeout = timedelta(seconds=self.config.quorum_timeout_s)
        self._store = TCPStore(r.address, 0, is_master=True, wait_for_workers=False, timeout=quorum_timeout)
        self.pg = ProcessGroupGloo(timeout=timeout)
        self.manager = Manager(
            pg=self.pg, min_replica_size=self.config.quorum_min_replicas, use_async_quorum=False,
            load_state_dict=self._load_heal, state_dict=self._heal_state, replica_id=r.replica_id,
            store_addr=r.address, store_port=self._store.port, rank=0, world_size=1, lighthouse_addr=r.lighthouse,
            hostname=r.address, timeout=timeout, quorum_timeout=quorum_timeout, connect_timeout=quorum_timeout,
            checkpoint_transport=checkpoint_transport(r.address, self.timeout_s), init_sync=True)
        return model

    def join(self, position: Callable[[], dict]) -> None:
        """The first quorum, before the loop and after a resumed checkpoint is loaded (the session
        calls it then): every replica starts from one replica's weights (torchft's init_sync), and
        one that joins a running job, or resumed from an older checkpoint than its peers, heals
        from a peer (`moved_to`: the peer's place). `position()`: the loop's place, sent to
        replicas that heal from this one."""
        self._position = position
        self._quorum(int(position().get("steps", 0)))  # a resumed loop: its checkpoint's step

    def moved_to(self) -> dict | None:
        moved, self._moved = self._moved, None
        if moved is not None and moved.get("steps"):  # a heal into a running job (not the start's init_sync)
            print(f"replica group {self.replica.index}: healed from a peer (outer step {self.outer_steps}); "
                  f"going on after step {moved.get('steps')}", file=sys.stderr, flush=True)
        return moved

    def data_shard(self) -> tuple[int, int]:
        """Each replica group reads its own shard of `count`, present or not (torchft's way:
        the shard of a dead group is not read while it is away)."""
        return self.replica.index, self.replica.count

    # -- the loop's calls -----------------------------------------------------------------------

    def step(self, optimizer: "torch.optim.Optimizer", step: int) -> None:
        if self._drain == "left":
            raise UserError(f"replica group {self.replica.index} was drained at step {self.drained_at} and left the "
                            "quorum, but the loop went on: stop it when session.should_stop is set "
                            "(`if s.should_stop: break`)")
        inner = self._round_open  # no quorum in this step
        if not self._round_open:
            self._quorum(step - 1)
            if self._moved is not None:  # healed from a peer: this is the step after the peer's last
                step = self._moved["steps"] = int(self._moved["steps"]) + 1
            if self._drain == "next":
                self._leave_this_round(step)
        optimizer.step()
        self._step = step
        self.steps_since_sync[0] += 1
        now = time.perf_counter()
        if inner and self._stepped_at is not None:  # the last step had no sync (it would have closed the round)
            self._inner_s = (self._inner_s + [now - self._stepped_at])[-9:]
        self._stepped_at = now
        if self._drain is None and self.replica.drain_file and os.path.exists(self.replica.drain_file):
            self._drain_requested(step)
        if step % self.config.sync_every == 0:
            self._sync(0)

    def is_sync_point(self, step: int) -> bool:
        return step % self.config.sync_every == 0

    def left(self) -> bool:
        return self._drain == "left"

    def finalize(self, step: int) -> None:
        """A last sync over the quorum when the loop stopped mid-round (not after a drain: the
        replica took part in its last sync and is out of the quorum)."""
        self._step = step
        if self._drain == "left":
            return
        if self.steps_since_sync[0] > 0:
            if not self._round_open:
                self._quorum(step)
            self._pre_finalize_state = self._state(include_local=True)
            self._sync(0)

    def lr_scale(self) -> float:
        """DiLoCo's inner lr factor over the replica groups the job was planned with (each steps on
        1/count of the global batch), not over this process's group of one."""
        from vpscluster.train.strategies.diloco import inner_lr_scale

        return inner_lr_scale(self.config.inner_lr_scale, self.replica.count)

    def participants(self) -> int:
        return self.manager.num_participants() if self.manager is not None else 1

    # -- the quorum and the sync ----------------------------------------------------------------

    def _quorum(self, completed: int) -> None:
        from datetime import timedelta

        self._completed = completed
        t0 = time.perf_counter()
        try:
            self.manager.start_quorum(timeout=timedelta(seconds=self.config.quorum_timeout_s))
        except Exception as e:  # the lighthouse unreachable, or too few replicas within the time-out
            why = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
            raise QuorumLost(
                f"replica group {self.replica.index}: no quorum of {self.config.quorum_min_replicas} replica groups "
                f"within {self.config.quorum_timeout_s:g} s at the lighthouse {self.replica.lighthouse} ({why}); "
                "the lighthouse is gone or too few replicas remain: the run's relaunch path takes over") from None
        waited = time.perf_counter() - t0
        self.quorum_wait_seconds += waited
        self.comm.add(waited, 0)  # waiting for the others, as a collective does
        if self.manager.errored() is not None:
            print(f"warning: replica group {self.replica.index}: quorum set-up failed ({self.manager.errored()}); "
                  "this round's sync is skipped", file=sys.stderr, flush=True)
        self.quorums += 1
        self.participants_seen.append(self.participants())
        self._round_open = True

    # -- draining ---------------------------------------------------------------------------------

    def _drain_requested(self, step: int) -> None:
        """The launcher asked this replica to leave (its drain file exists), seen after `step`:
        leave at this round's sync when at least the lighthouse's heartbeat time-out of the round
        is left (the others' next quorum then finds it silent), else at the next round's."""
        every = self.config.sync_every
        left_steps = (every - step % every) % every
        median_s = sorted(self._inner_s)[len(self._inner_s) // 2] if self._inner_s else 0.0
        # A quarter more than the time-out: step times jitter, and a late stop costs the others the rest.
        if left_steps and left_steps * median_s >= 1.25 * self.replica.heartbeat_timeout_s:
            self._leave_this_round(step)
            return
        self._drain = "next"
        print(f"replica group {self.replica.index}: asked to drain at step {step}: leaving the quorum after the next "
              "round's outer sync", file=sys.stderr, flush=True)

    def _leave_this_round(self, step: int) -> None:
        """Stop heartbeating to the lighthouse (the ManagerServer shut down; this round's sync
        needs only the process group) and make this round's sync the last."""
        self._drain = "this"
        server = getattr(self.manager, "_manager", None)  # torchft 0.2.0: the ManagerServer of group rank 0
        if server is not None:
            server.shutdown()
            self.manager._manager = None
        last = step + (self.config.sync_every - step % self.config.sync_every) % self.config.sync_every
        print(f"replica group {self.replica.index}: draining: out of the lighthouse's next quorum; its last outer "
              f"sync is at step {last}", file=sys.stderr, flush=True)

    def _sync(self, f: int) -> None:
        """The round's outer sync over the quorum; skipped (nothing applied) where it failed."""
        from datetime import timedelta

        self._round_open = False  # the next step starts a new quorum
        self.syncs_attempted += 1
        delta = self.global_flat[f] - self._local_flat(f)
        reduced = None
        if self.manager.errored() is None:
            try:
                reduced = self._reduce(self.tokens_since_sync[f], delta, self.pg, self.comm)
            except Exception as e:  # a peer died or timed out mid-reduction
                if e.__context__ is not None and "world group map" in str(e):
                    # torch's c10d logger, formatting the failure, fails on torchft's group when a
                    # default group exists (under torchrun) and hides the reason: name the reason.
                    e = e.__context__
                why = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
                print(f"warning: replica group {self.replica.index}: outer sync {self.syncs_attempted} failed: {why}",
                      file=sys.stderr, flush=True)
                self.manager.report_error(e)
                # Close this replica's connections now: a peer still waiting on it in this
                # reduction fails at once instead of at its time-out (the next quorum rebuilds them).
                self.pg.abort()
        if self._drain == "this":  # its last sync: no ManagerServer to ask, a group of one commits its own outcome
            self._drain, self.drained_at = "left", self._step
            if reduced is None:
                self.syncs_failed += 1
            else:
                self._commit(f, reduced)
            lost = "" if reduced is not None else " (that sync failed: its last round's pseudo-gradient did not count)"
            print(f"replica group {self.replica.index}: {DRAINED}{self._step}: left the quorum after outer step "
                  f"{self.outer_steps}{lost}", file=sys.stderr, flush=True)
            return
        commit = self.manager.should_commit(timeout=timedelta(seconds=self.timeout_s))
        if not commit or reduced is None:
            self.syncs_failed += 1  # the next sync carries this round's steps and tokens
            return
        self._commit(f, reduced)

    def _commit(self, f: int, reduced) -> None:
        self._outer_update(f, reduced)
        self._write_local(f, self.global_flat[f])
        self.steps_since_sync[f] = 0
        self.tokens_since_sync[f] = 0.0
        self.outer_steps += 1

    # -- healing (torchft's checkpoint transport calls these on its threads) --------------------

    def _heal_state(self) -> dict[str, Any]:
        """What a replica that is behind loads from this one: copies (served while this one trains on)."""
        position = dict(self._position()) if self._position is not None else {}
        position["steps"] = self._completed
        return {"diloco": self._state(include_local=False), "position": position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """A checkpoint resumed (`Session.resume`, before `join`): the Manager's step becomes the
        checkpoint's outer-step count, so replica groups that resumed from different checkpoints
        (a relaunch: one saved at its stop, another was killed first) line up at the first
        quorum: those behind heal from the one ahead, the loop's place included."""
        super().load_state_dict(state)
        if getattr(self, "manager", None) is not None and not getattr(self, "_healing", False):
            self.manager.load_state_dict({"step": self.outer_steps, "batches_committed": self.manager.batches_committed()})
            self._round_open = False

    def _load_heal(self, payload: dict[str, Any]) -> None:
        state = dict(payload["diloco"])
        # θ_r = θ_global: this replica starts the round where the peer's outer step left it.
        state.update(steps_since_sync=[0], tokens_since_sync=[0.0], in_flight=[], sparse_ef=None)
        self._healing = True  # torchft restores the Manager's own step
        try:
            self.load_state_dict(state)
        finally:
            self._healing = False
        self._write_local(0, self.global_flat[0])
        self._moved = payload.get("position")
        self.heals += 1

    # -- the rest -----------------------------------------------------------------------------

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "quorum": True, "replica_group": self.replica.index, "drained_at": self.drained_at,
                "replica_groups": self.replica.count, "quorums": self.quorums, "heals": self.heals,
                "quorum_wait_seconds": self.quorum_wait_seconds,
                "participants_min": min(self.participants_seen, default=None),
                "participants_max": max(self.participants_seen, default=None)}

    def close(self) -> None:
        super().close()
        if self.manager is not None:
            self.manager.shutdown(wait=False)
            self.manager = None
