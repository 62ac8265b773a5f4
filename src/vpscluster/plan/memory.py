"""Memory one rank needs: model states, activations, strategy buffers; and what makes it fit.

Model states (Rajbhandari et al., 2020, "ZeRO", section 3.1): Adam keeps fp32 weights, fp32
gradients and two fp32 moments: 16 bytes per parameter in plain fp32 training (CPU), and also 16
in mixed precision (bf16 weights 2 + bf16 gradients 2 + fp32 master weights 4 + moments 8).
Sharding options divide parts of it by the data-parallel degree n: ZeRO-1 the optimizer state
(moments and master weights), ZeRO-2 also gradients, FSDP (ZeRO-3) also weights.

Activations per layer (Korthikanti et al., 2022, "Reducing Activation Recomputation in Large
Transformer Models", section 4.1), counted in elements per token and re-derived for vpscluster's
block (no dropout, flash attention through scaled_dot_product_attention, so no s x s scores):
LayerNorm inputs 2h, the attention input h, Q, K, V 3h, attention output h, MLP input h and the
MLP's hidden activations 2f (4f when gated: gate, up, act(gate), product) -> 8h + 2f (+ a*s per
token when attention scores are materialised). The output head keeps logits and the fp32
log-softmax: s*b*V*(act_bytes + 4). Full activation checkpointing keeps only each layer's input
(h per token) plus one layer's activations during recomputation.

Strategy buffers: DDP's buckets are views of the gradients (vpscluster sets
gradient_as_bucket_view), bf16 compression adds a half-size wire copy, PowerSGD keeps an
error-feedback copy of the gradients; DiLoCo keeps fp32 global weights and outer momentum (8 bytes
per parameter, Douillard et al., 2023), a pseudo-gradient and its wire buffers (for int8,
all_gather receives every rank's quantized tensor: n bytes per parameter).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vpscluster.plan.shapes import ModelSpec
from vpscluster.train.strategies import costs_for

RUNTIME_BYTES = {"ram": 600 * 2**20, "gpu": 1 * 2**30}  # Python + torch (+ CUDA context on GPU)
HEADROOM = 0.9  # plan to use at most this share of a node's memory (fragmentation, OS)
SHARDINGS = ("none", "zero1", "zero2", "fsdp")


@dataclass(frozen=True)
class MemoryOption:
    """A way of laying the model out on one rank."""

    sharding: str = "none"  # none | zero1 | zero2 | fsdp
    checkpointing: bool = False  # full activation recomputation per layer
    micro_batch: int | None = None  # None: the model's batch size (no gradient accumulation)

    def describe(self) -> str:
        parts = [] if self.sharding == "none" else [{"zero1": "sharded optimizer (ZeRO-1)",
                                                        "zero2": "sharded optimizer and gradients (ZeRO-2)",
                                                        "fsdp": "fully sharded (FSDP)"}[self.sharding]]
        if self.checkpointing:
            parts.append("activation checkpointing")
        if self.micro_batch is not None:
            parts.append(f"micro-batch {self.micro_batch} with gradient accumulation")
        return ", ".join(parts) or "as configured"


@dataclass
class MemoryEstimate:
    components: dict[str, float] = field(default_factory=dict)  # name -> bytes

    @property
    def total_bytes(self) -> float:
        return sum(self.components.values())

    def to_dict(self) -> dict:
        return {"total_bytes": int(self.total_bytes), **{f"{k}_bytes": int(v) for k, v in self.components.items()}}


def model_state_bytes(num_params: int, mixed_precision: bool) -> dict[str, float]:
    """Weights, gradients and Adam state per parameter (ZeRO's accounting), unsharded."""
    if mixed_precision:
        return {"weights": 2.0 * num_params, "gradients": 2.0 * num_params, "optimizer": 12.0 * num_params}
    return {"weights": 4.0 * num_params, "gradients": 4.0 * num_params, "optimizer": 8.0 * num_params}


def activation_bytes(model: ModelSpec, micro_batch: int, act_bytes: int, checkpointing: bool,
                     flash_attention: bool = True) -> float:
    """Activations kept for backward for one micro-batch (see the module docstring)."""
    s = model.shape
    h, f, a, seq = s.d_model, s.d_ff, s.n_head, s.seq_len
    tokens = seq * micro_batch
    mlp = 4 * f if s.gated_mlp else 2 * f
    per_token_layer = 8 * h + mlp + (0 if flash_attention else a * seq)
    layer = tokens * per_token_layer * act_bytes
    head = tokens * s.vocab_size * (act_bytes + 4)
    embed = tokens * h * act_bytes
    if checkpointing:
        return s.n_layer * tokens * h * act_bytes + layer + head + embed
    return s.n_layer * layer + head + embed


def estimate(model: ModelSpec, strategy: str, world_size: int, *, mixed_precision: bool,
             memory_kind: str = "ram", option: MemoryOption = MemoryOption(), compress: str = "none",
             wire_dtype: str = "fp32", fragments: int = 1) -> MemoryEstimate:
    """Bytes one rank needs for `strategy` (a registered name) with `option`; what the strategy
    holds of its own comes from its cost companion (`train/strategies/*_costs.py`)."""
    p = model.num_params()
    n = max(1, world_size)
    states = model_state_bytes(p, mixed_precision)
    divisor = {"none": (1, 1, 1), "zero1": (1, 1, n), "zero2": (1, n, n), "fsdp": (n, n, n)}[option.sharding]
    comp = {
        "weights": states["weights"] / divisor[0],
        "gradients": states["gradients"] / divisor[1],
        "optimizer": states["optimizer"] / divisor[2],
    }
    if option.sharding == "fsdp" and n > 1:
        # FSDP gathers one layer's full weights (and reduce-scatters its gradients) at a time.
        comp["gathered_layer"] = 2 * (states["weights"] + states["gradients"]) / model.shape.n_layer
    act_bytes = 2 if mixed_precision else 4
    micro = option.micro_batch or model.shape.batch_size
    comp["activations"] = activation_bytes(model, micro, act_bytes, option.checkpointing)
    grad_bytes = states["gradients"] / divisor[1]
    comp.update(costs_for(strategy).memory_components(num_params=p, world_size=n, grad_bytes=grad_bytes,
                                                      sharding=option.sharding, compress=compress,
                                                      wire_dtype=wire_dtype, fragments=fragments))
    comp["runtime"] = float(RUNTIME_BYTES[memory_kind])
    return MemoryEstimate(comp)


def fitting_options(model: ModelSpec, strategy: str, world_size: int, available_bytes: float, *,
                    mixed_precision: bool, memory_kind: str, **kw) -> list[tuple[MemoryOption, MemoryEstimate]]:
    """Options (least intrusive first) that fit in `available_bytes`; empty when none does."""
    out = []
    for opt in candidate_options(model, strategy, world_size):
        est = estimate(model, strategy, world_size, mixed_precision=mixed_precision,
                       memory_kind=memory_kind, option=opt, **kw)
        if est.total_bytes <= available_bytes * HEADROOM:
            out.append((opt, est))
    return out


def candidate_options(model: ModelSpec, strategy: str, world_size: int) -> list[MemoryOption]:
    """Ways to make a model fit, ordered by what they cost (time, then complexity)."""
    b = model.shape.batch_size
    micro = sorted({m for m in (b // 2, b // 4, 1) if 1 <= m < b}, reverse=True)
    opts = [MemoryOption(), MemoryOption(checkpointing=True)]
    opts += [MemoryOption(micro_batch=m) for m in micro]
    opts += [MemoryOption(checkpointing=True, micro_batch=m) for m in micro]
    # DiLoCo replicates the whole model by design (it avoids per-step traffic), so sharding
    # across nodes is only offered for DDP.
    if costs_for(strategy).shards_state and world_size > 1:
        for sharding in SHARDINGS[1:]:
            opts.append(MemoryOption(sharding=sharding))
            opts.append(MemoryOption(sharding=sharding, checkpointing=True))
            opts += [MemoryOption(sharding=sharding, checkpointing=True, micro_batch=m) for m in micro[-1:]]
    return opts


def least_memory_bytes(model: ModelSpec, strategy: str, world_size: int, *, mixed_precision: bool,
                       memory_kind: str, **kw) -> tuple[float, MemoryOption]:
    """The smallest per-rank memory with which the model trains at all, and how."""
    best = None
    for opt in candidate_options(model, strategy, world_size):
        est = estimate(model, strategy, world_size, mixed_precision=mixed_precision, memory_kind=memory_kind,
                       option=opt, **kw)
        need = est.total_bytes / HEADROOM
        if best is None or need < best[0]:
            best = (need, opt)
    return best
