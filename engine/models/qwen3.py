"""Qwen3 (dense): Llama's decoder with an RMS norm over each head of Q and K before the rotary
embedding, and no biases."""

from __future__ import annotations

import torch
from torch import nn

from engine.models.arch_config import ArchConfig
from engine.models.decoder import Attention, CausalLM, DecoderLayer
from engine.models.layers import RMSNorm, RotaryEmbedding


class Qwen3DecoderLayer(DecoderLayer):
    """A Llama layer whose attention normalizes each head of Q and K."""

    def build_attention(
        self, config: ArchConfig, layer_index: int, rotary_emb: RotaryEmbedding, dtype: torch.dtype
    ) -> nn.Module:
        return Attention(config, layer_index, rotary_emb, dtype, qk_norm=RMSNorm)


class Qwen3ForCausalLM(CausalLM):
    """Qwen3's dense models (0.6B to 32B)."""

    layer_class = Qwen3DecoderLayer
