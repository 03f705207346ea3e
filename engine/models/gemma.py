"""Gemma 2 and Gemma 3 (text): a decoder with norms before and after both the attention and the MLP,
RMS norms that scale by (1 + weight), a GeGLU MLP, embeddings scaled by sqrt(hidden_size), scores
scaled by `query_pre_attn_scalar`, alternating sliding-window and global layers (Gemma 3's with RoPE
bases of their own), soft-capped scores and logits (Gemma 2) and per-head q/k norms (Gemma 3)."""

from __future__ import annotations

import torch
from torch import nn

from engine.models.arch_config import ArchConfig
from engine.models.decoder import Attention, CausalLM, DecoderLayer
from engine.models.layers import RMSNorm, RotaryEmbedding
from parallel.layers import default_weight_loader


def _load_plus_one(param: torch.Tensor, loaded: torch.Tensor) -> None:
    default_weight_loader(param, loaded.float() + 1.0)


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMS norm multiplies by (1 + weight): the loader adds the one, in float32, once."""

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype | None = None) -> None:
        super().__init__(hidden_size, eps, dtype)
        self.weight.weight_loader = _load_plus_one  # type: ignore[attr-defined]


class Gemma2DecoderLayer(DecoderLayer):
    """Sandwich norms: x + post_attn(attn(in(x))), then x + post_ff(mlp(pre_ff(x)))."""

    norm_class = GemmaRMSNorm
    qk_norm: type[RMSNorm] | None = None

    def __init__(
        self, config: ArchConfig, layer_index: int, rotary_emb: RotaryEmbedding, dtype: torch.dtype
    ) -> None:
        super().__init__(config, layer_index, rotary_emb, dtype)
        self.pre_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.post_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps, dtype)

    def build_attention(
        self, config: ArchConfig, layer_index: int, rotary_emb: RotaryEmbedding, dtype: torch.dtype
    ) -> nn.Module:
        scale = config.query_pre_attn_scalar**-0.5 if config.query_pre_attn_scalar else None
        return Attention(config, layer_index, rotary_emb, dtype, qk_norm=self.qk_norm, scale=scale)

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.post_attention_layernorm(self.self_attn(positions, hidden))
        hidden, residual = self.pre_feedforward_layernorm(hidden, residual)
        return self.post_feedforward_layernorm(self.mlp(hidden)), residual


class Gemma3DecoderLayer(Gemma2DecoderLayer):
    """Gemma 2's layer with Gemma's RMS norm over each head of Q and K."""

    qk_norm = GemmaRMSNorm


class Gemma2ForCausalLM(CausalLM):
    """Gemma 2 (2B, 9B, 27B)."""

    layer_class = Gemma2DecoderLayer
    embed_scaled = True


class Gemma3ForCausalLM(CausalLM):
    """Gemma 3's text-only checkpoints (1B; the larger ones' language model)."""

    layer_class = Gemma3DecoderLayer
    embed_scaled = True
