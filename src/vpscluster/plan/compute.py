"""Compute time per step: training FLOPs over the FLOP/s a node really reaches on this model.

FLOPs per token: 6 per parameter (forward 2, backward 4) plus causal attention
(Kaplan et al., 2020; Chowdhery et al., 2022, PaLM appendix B) — `ModelShape.flops_per_token`.
Forward takes one third of it and backward two thirds.

The probe measures a large fp32 matmul (the best case). A training step reaches only a share of
that (smaller matmuls, LayerNorm, softmax, the optimizer, Python): `efficiency`. It is either
measured on this machine for this very model by `plan.calibrate` (a few real forward/backward/
AdamW steps timed against the probe's own matmul benchmark on the same cores — a property of the
model's kernels, carried to every node through its measured FLOP/s) or assumed and said so.

Better still, a node's compute time per step measured on that node for this very model
(`plan.steptime`, `NodeResources.step_seconds`) replaces the FLOP/s model for that node.
"""

from __future__ import annotations

from dataclasses import dataclass

from vpscluster.plan.resources import NodeResources
from vpscluster.plan.shapes import ModelSpec

ASSUMED_EFFICIENCY = {"ram": 0.5, "gpu": 0.4}


@dataclass(frozen=True)
class Efficiency:
    value: float
    source: str  # "calibrated" | "assumed"

    def describe(self) -> str:
        if self.source == "calibrated":
            return f"a training step reaches {self.value:.0%} of matmul FLOP/s (measured here for this model)"
        return (f"a training step assumed to reach {self.value:.0%} of the probe's matmul FLOP/s; "
                "run `vpscluster plan --calibrate` to measure it for this model")


@dataclass(frozen=True)
class NodeCompute:
    name: str
    forward_s: float
    backward_s: float

    @property
    def seconds(self) -> float:
        return self.forward_s + self.backward_s


def with_extra(c: NodeCompute, seconds: float) -> NodeCompute:
    """`c` plus `seconds` of work that is not the model's (counted with backward)."""
    return NodeCompute(c.name, c.forward_s, c.backward_s + seconds) if seconds > 0 else c


def tokens_per_rank_step(model: ModelSpec) -> int:
    return model.shape.batch_size * model.shape.seq_len


def node_compute(model: ModelSpec, node: NodeResources, efficiency: float, tokens: int | None = None) -> NodeCompute:
    """Seconds one rank of `node` needs for a step of `tokens` tokens (default: its batch)."""
    tokens = tokens_per_rank_step(model) if tokens is None else tokens
    if node.step_seconds and node.step_tokens:  # measured on this node for this model (plan.steptime)
        seconds = node.step_seconds * tokens / node.step_tokens
    else:
        seconds = model.flops_per_token() * tokens / (node.flops * efficiency)
    return NodeCompute(node.name, seconds / 3, 2 * seconds / 3)


def balanced_shares(nodes: list[NodeResources]) -> list[float]:
    """Batch shares proportional to each rank's FLOP/s: every rank then finishes together."""
    total = sum(n.flops * n.ranks for n in nodes)
    return [n.flops * n.ranks / total for n in nodes]
