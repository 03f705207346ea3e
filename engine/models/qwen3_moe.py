"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention, with a mixture of experts as the
MLP of every decoder_sparse_step-th layer outside mlp_only_layers and a dense gated MLP elsewhere."""

from __future__ import annotations

import torch
from torch import nn

from engine.models.arch_config import ArchConfig
from engine.models.moe import MoECausalLM, build_moe_mlp
from engine.models.qwen3 import Qwen3DecoderLayer


class Qwen3MoeDecoderLayer(Qwen3DecoderLayer):
    """A Qwen3 layer whose MLP is sparse where the config says so."""

    def build_mlp(self, config: ArchConfig, layer_index: int, dtype: torch.dtype) -> nn.Module:
        return build_moe_mlp(config, layer_index, dtype)


class Qwen3MoeForCausalLM(MoECausalLM):
    """Qwen3's mixtures of experts; the router's top-k weights are renormalized where the config's
    norm_topk_prob says."""

    layer_class = Qwen3MoeDecoderLayer
