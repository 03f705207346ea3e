"""Qwen2-MoE (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): Qwen2's attention (biased Q, K and V), and on
its sparse layers routed experts plus a shared expert that every token goes through, weighted by a
sigmoid gate of its own (`SharedExpertMoeBlock`)."""

from __future__ import annotations

import torch
from torch import nn

from engine.models.arch_config import ArchConfig
from engine.models.decoder import DecoderLayer
from engine.models.moe import MoECausalLM, build_moe_mlp


class Qwen2MoeDecoderLayer(DecoderLayer):
    """A Qwen2 layer whose MLP is sparse where the config says so."""

    def build_mlp(self, config: ArchConfig, layer_index: int, dtype: torch.dtype) -> nn.Module:
        return build_moe_mlp(config, layer_index, dtype)


class Qwen2MoeForCausalLM(MoECausalLM):
    """Qwen2's mixtures of experts with a shared expert."""

    layer_class = Qwen2MoeDecoderLayer
