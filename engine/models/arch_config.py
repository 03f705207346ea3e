"""The shape of a model, read from a Hugging Face config.json or a GGUF header.

One small dataclass instead of transformers' config classes keeps the model code independent of
how a checkpoint spells its settings (`rope_theta` + `rope_scaling` in transformers 4,
`rope_parameters` in transformers 5, `llama.rope.freq_base` in GGUF).
"""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class ArchConfig:
    """Hyper-parameters of a Llama-family decoder."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    rope_scaling: dict[str, Any] | None = None
    sliding_window: int | None = None
    torch_dtype: str | None = None
    eos_token_ids: tuple[int, ...] = ()

    @classmethod
    def from_hf_config(
        cls, config: dict[str, Any], generation_config: dict[str, Any] | None = None
    ) -> ArchConfig:
        architectures = config.get("architectures") or [config.get("model_type", "unknown")]
        architecture = architectures[0]
        num_heads = config["num_attention_heads"]
        rope = config.get("rope_parameters") or {}
        rope_theta = rope.get("rope_theta", config.get("rope_theta", 10000.0))
        scaling = config.get("rope_scaling") or (
            rope if rope.get("rope_type", "default") != "default" else None
        )
        is_qwen2 = architecture.startswith("Qwen2")
        attention_bias = bool(config.get("attention_bias", False))
        sliding_window = config.get("sliding_window")
        if is_qwen2 and not config.get("use_sliding_window", False):
            sliding_window = None
        eos: list[int] = []
        for source in (config, generation_config or {}):
            value = source.get("eos_token_id")
            eos.extend(value if isinstance(value, list) else [] if value is None else [value])
        return cls(
            architecture=architecture,
            vocab_size=config["vocab_size"],
            hidden_size=config["hidden_size"],
            intermediate_size=config["intermediate_size"],
            num_layers=config["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=config.get("num_key_value_heads") or num_heads,
            head_dim=config.get("head_dim") or config["hidden_size"] // num_heads,
            rms_norm_eps=config.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            max_position_embeddings=config.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            # Qwen2 always has biases on Q, K and V (and never on the output projection).
            qkv_bias=is_qwen2 or attention_bias,
            o_bias=attention_bias and not is_qwen2,
            mlp_bias=bool(config.get("mlp_bias", False)),
            rope_scaling=dict(scaling) if scaling else None,
            sliding_window=sliding_window,
            torch_dtype=config.get("torch_dtype") or config.get("dtype"),
            eos_token_ids=tuple(dict.fromkeys(eos)),
        )
