"""A GPT-style decoder built from a `ModelShape` (Radford et al., 2019: GPT-2 with pre-norm blocks).

Token and learned position embeddings, `n_layer` pre-norm blocks (LayerNorm -> causal
self-attention -> residual, LayerNorm -> MLP -> residual), a final LayerNorm and an output head
tied to the token embedding (Press & Wolf, 2017). Attention goes through
`torch.nn.functional.scaled_dot_product_attention`, which picks the fastest kernel the device
has. No dropout: runs must be bit-for-bit repeatable so that resume equals an uninterrupted run.

The parameters are exactly those counted by `ModelShape.num_params()`.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from vpscluster.train.presets import ModelShape


class CausalSelfAttention(nn.Module):
    def __init__(self, shape: ModelShape) -> None:
        super().__init__()
        self.n_head = shape.n_head
        self.qkv = nn.Linear(shape.d_model, 3 * shape.d_model)
        self.proj = nn.Linear(shape.d_model, shape.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        # (b, t, d) -> (b, heads, t, head_dim)
        q, k, v = (z.view(b, t, self.n_head, d // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).contiguous().view(b, t, d))


class MLP(nn.Module):
    """GELU MLP (GPT-2) or, for Llama-like shapes, a gated SiLU MLP (Shazeer, 2020: SwiGLU)."""

    def __init__(self, shape: ModelShape) -> None:
        super().__init__()
        self.gated = shape.gated_mlp
        self.fc = nn.Linear(shape.d_model, shape.d_ff)
        if self.gated:
            self.gate = nn.Linear(shape.d_model, shape.d_ff)
        self.proj = nn.Linear(shape.d_ff, shape.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.silu(self.gate(x)) * self.fc(x) if self.gated else F.gelu(self.fc(x))
        return self.proj(h)


class Block(nn.Module):
    def __init__(self, shape: ModelShape) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(shape.d_model)
        self.attn = CausalSelfAttention(shape)
        self.ln2 = nn.LayerNorm(shape.d_model)
        self.mlp = MLP(shape)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, shape: ModelShape) -> None:
        super().__init__()
        self.shape = shape
        self.tok_emb = nn.Embedding(shape.vocab_size, shape.d_model)
        self.pos_emb = nn.Embedding(shape.seq_len, shape.d_model)
        self.blocks = nn.ModuleList(Block(shape) for _ in range(shape.n_layer))
        self.ln_f = nn.LayerNorm(shape.d_model)
        self.apply(self._init_weights)
        # GPT-2: scale the residual projections by 1/sqrt(2 * n_layer) so the residual stream's
        # variance does not grow with depth.
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * shape.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Mean next-token cross-entropy when `targets` is given, else the logits."""
        t = idx.shape[1]
        if t > self.shape.seq_len:
            raise ValueError(f"sequence of {t} tokens is longer than the model's seq_len {self.shape.seq_len}")
        pos = torch.arange(t, device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)
        for block in self.blocks:
            x = block(x)
        # The output head is the token embedding, transposed (tied weights).
        logits = F.linear(self.ln_f(x), self.tok_emb.weight)
        if targets is None:
            return logits
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))


def build_model(shape: ModelShape, seed: int, device: "torch.device | str" = "cpu") -> GPT:
    """The model with weights that depend only on `seed`: identical on every rank."""
    gen_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        model = GPT(shape)
    finally:
        torch.random.set_rng_state(gen_state)
    return model.to(device)


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
