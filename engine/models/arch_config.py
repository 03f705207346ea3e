"""The shape of a model, read from a Hugging Face config.json or a GGUF header.

One small dataclass instead of transformers' config classes keeps the model code independent of
how a checkpoint spells its settings (`rope_theta` + `rope_scaling` in transformers 4,
`rope_parameters` in transformers 5, `llama.rope.freq_base` in GGUF).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from engine.models.rope_scaling import check_rope_scaling, rope_max_positions

SLIDING, FULL = "sliding_attention", "full_attention"


@dataclasses.dataclass(frozen=True)
class ArchConfig:
    """Hyper-parameters of a decoder-only transformer; the families' own settings default to off."""

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
    # Per layer, SLIDING or FULL; empty: every layer slides when there is a window (Mistral).
    layer_types: tuple[str, ...] = ()
    # The RoPE base of sliding layers where it differs from the global layers' (Gemma 3).
    local_rope_theta: float | None = None
    hidden_act: str = "silu"
    # Gemma: attention scores scaled by query_pre_attn_scalar**-0.5 and soft-capped; logits too.
    query_pre_attn_scalar: float | None = None
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    # Mixtures of experts (Mixtral, Qwen3-MoE); num_experts 0 is a dense model.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    shared_expert_intermediate_size: int = 0
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()

    def layer_window(self, layer_index: int) -> int | None:
        """The sliding window of a layer in tokens (a query sees itself and the window - 1 before
        it), or None for full attention."""
        if not self.sliding_window:
            return None
        if not self.layer_types or self.layer_types[layer_index] == SLIDING:
            return self.sliding_window
        return None

    @property
    def max_context(self) -> int:
        """The longest sequence the model's positions serve (longer than max_position_embeddings
        under YaRN or dynamic NTK scaling)."""
        return rope_max_positions(self.max_position_embeddings, self.rope_scaling)

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        return tuple(self.layer_window(i) for i in range(self.num_layers))

    def layer_rope(self, layer_index: int) -> tuple[float, dict[str, Any] | None]:
        """The RoPE base and scaling of a layer: Gemma 3's sliding layers have their own base and no
        scaling."""
        if self.local_rope_theta is not None and self.layer_window(layer_index) is not None:
            return self.local_rope_theta, None
        return self.rope_theta, self.rope_scaling

    @classmethod
    def from_hf_config(
        cls, config: dict[str, Any], generation_config: dict[str, Any] | None = None
    ) -> ArchConfig:
        architectures = config.get("architectures") or [config.get("model_type", "unknown")]
        architecture = architectures[0]
        num_heads = config["num_attention_heads"]
        rope, local_rope = _rope_parameters(config)
        rope_theta = rope.get("rope_theta", config.get("rope_theta", 10000.0))
        scaling = config.get("rope_scaling") or (
            rope if rope.get("rope_type", "default") != "default" else None
        )
        if (factor := rope.get("partial_rotary_factor", config.get("partial_rotary_factor"))) not in (
            None,
            1.0,
        ):
            raise ValueError(
                f"model {architecture}: partial_rotary_factor {factor} is not supported (1.0 is)"
            )
        check_rope_scaling(scaling, architecture)
        is_qwen2 = architecture.startswith("Qwen2")
        attention_bias = bool(config.get("attention_bias", False))
        eos: list[int] = []
        for source in (config, generation_config or {}):
            value = source.get("eos_token_id")
            eos.extend(value if isinstance(value, list) else [] if value is None else [value])
        num_layers = config["num_hidden_layers"]
        return cls(
            architecture=architecture,
            vocab_size=config["vocab_size"],
            hidden_size=config["hidden_size"],
            intermediate_size=config["intermediate_size"],
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=config.get("num_key_value_heads") or num_heads,
            head_dim=config.get("head_dim") or config["hidden_size"] // num_heads,
            rms_norm_eps=config.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            max_position_embeddings=config.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            # Qwen2 has biases on Q, K and V (Qwen2-MoE says so in qkv_bias), never on the output.
            qkv_bias=bool(config.get("qkv_bias", is_qwen2 or attention_bias)),
            o_bias=attention_bias and not is_qwen2,
            mlp_bias=bool(config.get("mlp_bias", False)),
            rope_scaling=dict(scaling) if scaling else None,
            sliding_window=_sliding_window(config, is_qwen2 or architecture.startswith("Qwen3")),
            torch_dtype=config.get("torch_dtype") or config.get("dtype"),
            eos_token_ids=tuple(dict.fromkeys(eos)),
            layer_types=layer_types_of(config, architecture, num_layers),
            local_rope_theta=local_rope,
            hidden_act=config.get("hidden_activation") or config.get("hidden_act") or "silu",
            query_pre_attn_scalar=config.get("query_pre_attn_scalar"),
            attn_logit_softcapping=config.get("attn_logit_softcapping"),
            final_logit_softcapping=config.get("final_logit_softcapping"),
            num_experts=config.get("num_local_experts") or config.get("num_experts") or 0,
            num_experts_per_tok=config.get("num_experts_per_tok") or 0,
            moe_intermediate_size=config.get("moe_intermediate_size") or config["intermediate_size"],
            # Mixtral always renormalizes the top-k weights; Qwen's configs say whether they do
            # (transformers' default: not).
            norm_topk_prob=bool(config.get("norm_topk_prob", architecture.startswith("Mixtral"))),
            shared_expert_intermediate_size=config.get("shared_expert_intermediate_size") or 0,
            decoder_sparse_step=config.get("decoder_sparse_step") or 1,
            mlp_only_layers=tuple(config.get("mlp_only_layers") or ()),
        )


def _rope_parameters(config: dict[str, Any]) -> tuple[dict[str, Any], float | None]:
    """The global layers' RoPE settings, and the sliding layers' base where it is their own.

    transformers 5 nests Gemma 3's settings by layer type; transformers 4 has `rope_local_base_freq`.
    """
    rope = config.get("rope_parameters") or {}
    if FULL in rope:
        local = rope.get(SLIDING, {}).get("rope_theta")
        return rope[FULL], None if local is None else float(local)
    local = config.get("rope_local_base_freq")
    return rope, None if local is None else float(local)


def _sliding_window(config: dict[str, Any], qwen: bool) -> int | None:
    """Qwen2/3 configs carry a window that applies only with `use_sliding_window`."""
    if qwen and not config.get("use_sliding_window", False):
        return None
    return config.get("sliding_window")


def layer_types_of(config: dict[str, Any], architecture: str, num_layers: int) -> tuple[str, ...]:
    """Which layers slide: `layer_types` where the config has it (transformers 5), else each
    family's transformers 4 rule; empty where every layer is alike."""
    if types := config.get("layer_types"):
        return tuple(types)
    if architecture.startswith("Gemma2"):
        return tuple(SLIDING if i % 2 == 0 else FULL for i in range(num_layers))
    if architecture.startswith("Gemma3"):
        pattern = config.get("sliding_window_pattern", 6)
        return tuple(SLIDING if (i + 1) % pattern else FULL for i in range(num_layers))
    if architecture.startswith(("Qwen2", "Qwen3")) and config.get("use_sliding_window", False):
        first = config.get("max_window_layers", num_layers)
        return tuple(SLIDING if i >= first else FULL for i in range(num_layers))
    return ()
