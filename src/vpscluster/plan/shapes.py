"""The model the plan reasons about: a built-in preset or a Hugging Face style `config.json`.

A `ModelSpec` wraps `train.presets.ModelShape` (the GPT layout vpscluster trains) and adds what a
foreign config can differ in: an untied output head (Llama, Mistral: `tie_word_embeddings:
false`), so that parameter counts and traffic stay right for models the planner never trains.

Config keys understood (first one present wins):

    hidden size       hidden_size, n_embd, d_model
    layers            num_hidden_layers, n_layer, num_layers
    heads             num_attention_heads, n_head
    vocabulary        vocab_size
    sequence length   max_position_embeddings, n_positions, seq_length, n_ctx, max_seq_len
    MLP width         intermediate_size, n_inner, ffn_dim (absent or null: 4 x hidden)

Gated MLPs (SwiGLU: three matrices) are assumed for Llama-family `model_type`s and for
`hidden_act` silu/swiglu with an explicit intermediate size.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from vpscluster.errors import UserError
from vpscluster.train.presets import PRESETS, ModelShape

_GATED_MODEL_TYPES = {
    "llama", "mistral", "mixtral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3", "phi3",
    "olmo", "olmo2", "granite", "cohere", "deepseek_v2", "deepseek_v3", "internlm2", "yi",
}
_KEYS = {
    "d_model": ("hidden_size", "n_embd", "d_model"),
    "n_layer": ("num_hidden_layers", "n_layer", "num_layers"),
    "n_head": ("num_attention_heads", "n_head"),
    "vocab_size": ("vocab_size",),
    "seq_len": ("max_position_embeddings", "n_positions", "seq_length", "n_ctx", "max_seq_len"),
    "d_ff": ("intermediate_size", "n_inner", "ffn_dim"),
}


@dataclass(frozen=True)
class ModelSpec:
    """A model shape plus where it came from."""

    name: str
    shape: ModelShape
    untied_head: bool = False  # a separate output matrix (vocab x d_model) besides the embedding

    def num_params(self) -> int:
        extra = self.shape.vocab_size * self.shape.d_model if self.untied_head else 0
        return self.shape.num_params() + extra

    def flops_per_token(self) -> float:
        # The head's matmul is already counted by ModelShape (tied weights still cost the matmul).
        return self.shape.flops_per_token()

    def matrices(self) -> list[tuple[int, int]]:
        """(rows, cols) of every 2-D parameter: what PowerSGD compresses."""
        s = self.shape
        d, f = s.d_model, s.d_ff
        per_layer = [(3 * d, d), (d, d)] + ([(f, d), (f, d), (d, f)] if s.gated_mlp else [(f, d), (d, f)])
        mats = [(s.vocab_size, d), (s.seq_len, d)] + per_layer * s.n_layer
        if self.untied_head:
            mats.append((s.vocab_size, d))
        return mats

    def to_dict(self) -> dict:
        s = self.shape
        return {
            "name": self.name, "num_params": self.num_params(), "d_model": s.d_model,
            "n_layer": s.n_layer, "n_head": s.n_head, "seq_len": s.seq_len,
            "vocab_size": s.vocab_size, "d_ff": s.d_ff, "gated_mlp": s.gated_mlp,
            "untied_head": self.untied_head, "flops_per_token": self.flops_per_token(),
        }


def load_model(spec: str, batch_size: int | None = None, seq_len: int | None = None) -> ModelSpec:
    """A preset name or a path to a config.json (or a folder holding one)."""
    if spec.lower() in PRESETS:
        shape = PRESETS[spec.lower()]
        name = spec.lower()
        untied = False
    else:
        path = Path(spec)
        if path.is_dir():
            path = path / "config.json"
        looks_like_file = path.suffix == ".json" or "/" in spec or path.exists()
        if not looks_like_file:
            raise UserError(
                f"--model {spec!r}: not a preset and not a config.json; choose one of "
                f"{', '.join(PRESETS)} or give the path to a Hugging Face config.json"
            )
        shape, untied = _shape_from_config(path)
        name = str(spec)
    if batch_size is not None or seq_len is not None:
        from dataclasses import replace

        if batch_size is not None and batch_size < 1:
            raise UserError(f"--batch-size must be at least 1, got {batch_size}")
        if seq_len is not None and seq_len < 1:
            raise UserError(f"--seq-len must be at least 1, got {seq_len}")
        shape = replace(shape, batch_size=batch_size or shape.batch_size, seq_len=seq_len or shape.seq_len)
    return ModelSpec(name=name, shape=shape, untied_head=untied)


def _shape_from_config(path: Path) -> tuple[ModelShape, bool]:
    try:
        text = path.read_text()
    except OSError as e:
        raise UserError(f"--model {path}: cannot read it ({e.strerror}); give a preset name or a readable config.json") from None
    try:
        cfg = json.loads(text)
    except json.JSONDecodeError as e:
        raise UserError(f"--model {path}: not valid JSON (line {e.lineno}); give a Hugging Face config.json") from None
    if not isinstance(cfg, dict):
        raise UserError(f"--model {path}: expected a JSON object with the model's hyper-parameters")
    # Multimodal configs nest the language model (e.g. "text_config").
    if "text_config" in cfg and isinstance(cfg["text_config"], dict):
        cfg = {**cfg, **cfg["text_config"]}

    def pick(field: str, required: bool = True):
        for key in _KEYS[field]:
            value = cfg.get(key)
            if value is not None:
                if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                    raise UserError(f"--model {path}: {key} must be a positive integer, got {value!r}")
                return value
        if required:
            raise UserError(f"--model {path}: missing {' / '.join(_KEYS[field])}; is this a transformer config.json?")
        return 0

    d_model, n_layer, n_head = pick("d_model"), pick("n_layer"), pick("n_head")
    vocab, seq_len, d_ff = pick("vocab_size"), pick("seq_len"), pick("d_ff", required=False)
    model_type = str(cfg.get("model_type", "")).lower()
    act = str(cfg.get("hidden_act", cfg.get("activation_function", ""))).lower()
    gated = model_type in _GATED_MODEL_TYPES or (act in ("silu", "swiglu") and d_ff > 0)
    untied = cfg.get("tie_word_embeddings", True) is False
    try:
        shape = ModelShape(
            d_model=d_model, n_layer=n_layer, n_head=n_head, seq_len=seq_len, vocab_size=vocab,
            d_ff=d_ff, gated_mlp=gated, batch_size=1, trainable=False,
        )
    except UserError as e:
        raise UserError(f"--model {path}: {e}") from None
    return shape, untied
