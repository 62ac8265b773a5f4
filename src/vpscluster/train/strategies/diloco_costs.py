"""DiLoCo's cost companion (`costs.py`): H local steps, then one sync of the encoded
pseudo-gradient (`diloco.py`, `wire.py`, `sparse_wire.py`); H and the wire from the sync rule
(`sync_rule.py`)."""

from __future__ import annotations

import dataclasses
import math

from vpscluster.train.strategies import sparse_wire, sync_rule
from vpscluster.train.strategies.costs import StepNetwork, StrategyCosts, Traffic

REPRESENTATIVE_H = (10, 50, 100, 500)  # the plan's candidate table shows these H per wire


def diloco_exposed_seconds(round_s: float, alpha_s: float, n: int, sync_every: int, fragments: int,
                           overlap_steps: int, compute_s: float) -> tuple[float, float]:
    """(exposed, busy) seconds per inner step of DiLoCo's outer syncs.

    `round_s`: one whole-model sync. F fragments send the same bytes in F syncs per H steps, with
    F-1 more rounds of latency (3 collectives each). Blocking (τ = 0), every second is exposed.
    Overlapped (τ steps, `train/strategies/diloco.py`), a fragment's sync runs on one background
    thread behind τ steps of compute (τ at most H - 1, as the strategy clamps it): what outlasts
    them is exposed (the step that applies it waits); and with several fragments in flight the one
    thread serialises them, so no step is shorter than the thread's share of the network time."""
    total = round_s + (fragments - 1) * 3 * (n - 1) * alpha_s
    busy = total / sync_every
    tau = min(overlap_steps, sync_every - 1)
    if tau <= 0:
        return busy, busy
    late = fragments * max(0.0, total / fragments - tau * compute_s) / sync_every
    return max(late, busy - compute_s), busy


class DiLoCoCosts(StrategyCosts):
    name = "diloco"
    settings_keys = ("sync_every", "outer_lr", "outer_momentum", "outer_warmup", "wire_dtype", "inner_lr_scale",
                     "sync_timeout_s", "sync_retries", "sync_hashes", "fragments", "overlap_steps")
    planned_keys = sync_rule.KEYS
    state_bytes_per_param = 8.0  # the global weights and the outer momentum, fp32
    micro_batches_are_steps = True  # uneven shares: a faster rank does more inner steps per round

    def steps_per_sync(self, s) -> int:
        return s.sync_every

    def label(self, s) -> str:
        frag = f" F={s.fragments}" if s.fragments > 1 else ""
        return f"{self.name} H={s.sync_every} {s.wire_dtype}{frag}"

    def describe(self, s) -> dict:
        return {"name": self.name, "sync_every": s.sync_every, "wire_dtype": s.wire_dtype, "fragments": s.fragments,
                "overlap_steps": s.overlap_steps}

    def quality_risk(self, s, total_steps=None) -> float:
        risk = 1.0 + (s.sync_every > 50) + (s.sync_every > 100) + (s.sync_every > 250)
        # sparse: error feedback, but not yet measured here on long runs (issue 36 item 2)
        risk += {"fp32": 0.0, "bf16": 0.25, "int8": 0.5, "sparse4": 1.0, "sparse2": 1.0}[s.wire_dtype]
        if total_steps is not None and total_steps / s.sync_every < 20:
            risk += 2.0  # too few outer steps for the outer optimizer to do its work
        return risk

    def candidates(self, base, world_size, sync_every_choices) -> list:
        if world_size <= 1:
            return []
        # the sparse wires only when asked for, until measured (issue 36)
        return [dataclasses.replace(base, name=self.name, compress="none", sync_every=h, wire_dtype=wire, fragments=1)
                for h in sync_every_choices for wire in sync_rule.WIRES]

    def representative(self, s) -> bool:
        return s.sync_every in REPRESENTATIVE_H

    def sync_traffic(self, s, model, world_size) -> Traffic:
        """A token-count all-reduce, then the encoded pseudo-gradient reduce-scattered by
        `all_to_all` and the reduced chunks all-gathered (each phase sends (n-1)/n of the encoded
        buffer per rank); sparse wires all-gather every rank's buffer, tokens inside."""
        p = model.num_params()
        if s.wire_dtype in sparse_wire.SPARSE_WIRES:
            return [("allgather", float(sparse_wire.sparse_nbytes(p, sparse_wire.SPARSE_WIRES[s.wire_dtype])))]
        block = sync_rule.INT8_BLOCK
        unit = world_size * (block if s.wire_dtype == "int8" else 1)
        padded = math.ceil(p / unit) * unit
        encoded = {"fp32": 4.0 * padded, "bf16": 2.0 * padded, "int8": padded + 4.0 * padded / block}[s.wire_dtype]
        return [("allreduce", 8.0), ("alltoall", encoded), ("allgather", encoded / max(1, world_size))]

    def memory_components(self, *, num_params, world_size, grad_bytes, sharding, compress, wire_dtype,
                          fragments) -> dict[str, float]:
        p, n, frag = num_params, world_size, max(1, fragments)
        comp = {"diloco_global_weights": 4.0 * p, "diloco_outer_momentum": 4.0 * p}
        if n > 1 and wire_dtype.startswith("sparse"):
            # This rank's residual (whole model); per sync the pseudo-gradient, e + it, the next
            # residual, and every rank's buffer gathered (`sparse_wire.py`).
            comp["diloco_error_feedback"] = 4.0 * p
            comp["diloco_sync_buffers"] = (12.0 + n * sparse_wire.bytes_per_param(wire_dtype)) * p / frag
        elif n > 1:
            wire = {"fp32": 4.0, "bf16": 2.0, "int8": 1.0}[wire_dtype]
            # Pseudo-gradient in fp32, plus the encoded copy (int8: every rank's copy gathered).
            received = wire * n if wire_dtype == "int8" else (wire if wire_dtype != "fp32" else 0.0)
            comp["diloco_sync_buffers"] = (4.0 + received) * p / frag
        return comp

    def sync_compute_s(self, s, sync_extra_s) -> float:
        return sync_extra_s.get(s.wire_dtype, 0.0) / s.sync_every

    def exposed_seconds(self, s, net: StepNetwork) -> tuple[float, float]:
        round_s = net.collectives_seconds(self.sync_traffic(s, net.model, net.world_size))
        return diloco_exposed_seconds(round_s, net.alpha_s, net.world_size, s.sync_every, s.fragments,
                                      s.overlap_steps, net.compute_s)


COSTS = DiLoCoCosts()
