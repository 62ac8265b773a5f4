"""DDP's cost companion (`costs.py`): gradients all-reduced every step, in buckets during
backward, optionally compressed by a DDP communication hook (bf16, PowerSGD)."""

from __future__ import annotations

import dataclasses

from vpscluster.train.strategies.costs import StepNetwork, StrategyCosts, Traffic


def powersgd_allreduce_bytes(model, rank: int, min_compression_rate: float = 2.0) -> tuple[float, int]:
    """fp32 bytes all-reduced per step by torch's PowerSGD hook, and the number of collectives.

    A matrix m x n is sent as P (m x r) and Q (n x r) when that is at least
    `min_compression_rate` times smaller; vectors and small matrices go uncompressed.
    """
    total = 0.0
    for m, n in model.matrices():
        if (m + n) * rank * min_compression_rate < m * n:
            total += (m + n) * rank * 4
        else:
            total += m * n * 4
    total += (model.num_params() - sum(m * n for m, n in model.matrices())) * 4
    return total, 3  # uncompressed tensors, then P, then Q


def grad_bytes_per_param(compress: str) -> float:
    return 2.0 if compress == "bf16" else 4.0


class DDPCosts(StrategyCosts):
    name = "ddp"
    settings_keys = ("compress", "powersgd_rank", "powersgd_start_step", "bucket_mb")
    shards_state = True

    def is_plain(self, s) -> bool:
        return s.compress == "none"

    def label(self, s) -> str:
        return "ddp" if s.compress == "none" else f"ddp+{s.compress}" + (
            f" r={s.powersgd_rank}" if s.compress == "powersgd" else "")

    def describe(self, s) -> dict:
        d = {"name": self.name, "compress": s.compress, "bucket_mb": s.bucket_mb}
        if s.compress == "powersgd":
            d["powersgd_rank"] = s.powersgd_rank
        return d

    def quality_risk(self, s, total_steps=None) -> float:
        return {"none": 0.0, "bf16": 0.5, "powersgd": 3.0}.get(s.compress, 3.0)

    def candidates(self, base, world_size, sync_every_choices) -> list:
        from vpscluster.train.config import strategy_choices

        return [dataclasses.replace(base, name=self.name, compress=c) for c in strategy_choices("compress")]

    def sync_traffic(self, s, model, world_size) -> Traffic:
        """One all-reduce of the gradients (fp32, bf16, or PowerSGD's factors)."""
        if s.compress == "powersgd":
            total, _ = powersgd_allreduce_bytes(model, s.powersgd_rank)
            return [("allreduce", total)]
        return [("allreduce", model.num_params() * grad_bytes_per_param(s.compress))]

    def memory_components(self, *, num_params, world_size, grad_bytes, sharding, compress, wire_dtype,
                          fragments) -> dict[str, float]:
        comp: dict[str, float] = {}
        if world_size > 1 and sharding == "none":
            # vpscluster's DDP uses gradient_as_bucket_view: the buckets are the gradients, no copy.
            if compress == "bf16":
                comp["ddp_wire_buffers"] = grad_bytes / 2  # the bf16 copy of a bucket being sent
            if compress == "powersgd":
                comp["powersgd_error_feedback"] = 4.0 * num_params  # fp32 residual per gradient element
        return comp

    def exposed_seconds(self, s, net: StepNetwork) -> tuple[float, float]:
        if s.compress == "powersgd":
            # The PowerSGD hook compresses bucket by bucket too, but its P and Q all-reduces are
            # serialised behind the orthogonalisation; treat it as one exposed sync per step.
            traffic = self.sync_traffic(s, net.model, net.world_size)
            busy = net.collectives_seconds(traffic) + 2 * powersgd_allreduce_bytes(net.model, s.powersgd_rank)[1] * net.alpha_s
            return busy, busy
        return net.overlapped_allreduce_seconds(grad_bytes_per_param(s.compress), s.bucket_mb)


COSTS = DDPCosts()
