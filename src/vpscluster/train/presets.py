"""Named model shapes, from the ~1M-parameter `tiny` used in tests to 7B for planning.

Pure data and arithmetic (no torch import): the planner reasons about shapes that are never
trained here. `model.GPT` builds exactly the parameters counted by `ModelShape.num_params`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from vpscluster.errors import UserError


@dataclass(frozen=True)
class ModelShape:
    """A GPT-style decoder: learned positions, pre-norm blocks, tied input/output embedding."""

    d_model: int
    n_layer: int
    n_head: int
    seq_len: int
    vocab_size: int = 256  # the byte-level tokenizer
    d_ff: int = 0  # 0 means 4 * d_model
    gated_mlp: bool = False  # SwiGLU-style (three matrices) for Llama-like configs
    batch_size: int = 8  # default sequences per rank per step
    trainable: bool = True  # False: for planning only, too big for this machine

    def __post_init__(self) -> None:
        if self.d_model % self.n_head:
            raise UserError(f"model: d_model {self.d_model} is not divisible by n_head {self.n_head}")
        if self.d_ff == 0:
            object.__setattr__(self, "d_ff", 4 * self.d_model)

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    def num_params(self) -> int:
        d, f = self.d_model, self.d_ff
        mlp = (3 * d * f + 2 * f + d) if self.gated_mlp else (2 * d * f + f + d)
        attn = 4 * d * d + 4 * d  # qkv and output projections with biases
        norms = 2 * 2 * d  # two LayerNorms (weight and bias) per block
        block = attn + mlp + norms
        embed = self.vocab_size * d + self.seq_len * d  # tied output head adds nothing
        return embed + self.n_layer * block + 2 * d  # final LayerNorm

    def flops_per_token(self) -> float:
        """Training FLOPs per token: 6 per non-embedding parameter plus causal attention.

        Kaplan et al. (2020) / PaLM appendix B: 6N + 12 * n_layer * d_model * seq_len, where the
        attention term counts QK^T and AV in forward and backward (halved here for the causal mask
        would be the ideal; SDPA on CPU computes the full square, so it is not halved).
        """
        n = self.num_params() - self.vocab_size * self.d_model - self.seq_len * self.d_model
        # The output head (tied) still costs a matmul of vocab x d per token.
        n += self.vocab_size * self.d_model
        return 6.0 * n + 12.0 * self.n_layer * self.d_model * self.seq_len

    def to_dict(self) -> dict:
        return {**asdict(self), "num_params": self.num_params()}


PRESETS: dict[str, ModelShape] = {
    # ~1M parameters: tests and the demo (about a minute on 2 cores).
    "tiny": ModelShape(d_model=128, n_layer=5, n_head=4, seq_len=128, batch_size=16),
    # ~10M parameters: benchmarks (the reference slow-link scenario).
    "small": ModelShape(d_model=384, n_layer=6, n_head=6, seq_len=256, batch_size=4),
    # Real sizes, for planning (GPT-2/GPT-3 shapes with the GPT-2 BPE vocabulary).
    "125m": ModelShape(d_model=768, n_layer=12, n_head=12, seq_len=1024, vocab_size=50304, batch_size=8, trainable=False),
    "350m": ModelShape(d_model=1024, n_layer=24, n_head=16, seq_len=1024, vocab_size=50304, batch_size=8, trainable=False),
    "1.3b": ModelShape(d_model=2048, n_layer=24, n_head=16, seq_len=2048, vocab_size=50304, batch_size=4, trainable=False),
    "7b": ModelShape(d_model=4096, n_layer=32, n_head=32, seq_len=2048, vocab_size=50304, batch_size=2, trainable=False),
}


# The peak learning rate `train` uses when none is given (AdamW, 20 warm-up steps). `small` at
# 3e-3 stalled near validation loss 2.43 over 900-s runs of the reference scenario; at 2e-3 it
# reached 1.68 (BENCHMARKS.md, "wan"). The planning-only sizes keep DEFAULT_LR: not measured here.
DEFAULT_LR = 3e-3
PRESET_LR: dict[str, float] = {"tiny": 3e-3, "small": 2e-3}


def preset_lr(name: str) -> float:
    """The default peak learning rate for a preset (`PRESET_LR`, else DEFAULT_LR)."""
    get_preset(name)  # an unknown name: the same one-line error
    return PRESET_LR.get(name.lower(), DEFAULT_LR)


def preset_lrs_text() -> str:
    """The presets' default peak lrs for help texts, e.g. "tiny 0.003, small 0.002"."""
    return ", ".join(f"{name} {lr:g}" for name, lr in PRESET_LR.items())


def get_preset(name: str) -> ModelShape:
    try:
        return PRESETS[name.lower()]
    except KeyError:
        raise UserError(f"unknown preset {name!r}; choose one of: {', '.join(PRESETS)}") from None
