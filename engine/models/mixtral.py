"""Mixtral (8x7B, 8x22B): Llama's attention with a mixture of experts as every layer's MLP, its
checkpoint's `block_sparse_moe` with experts' `w1` (gate), `w3` (up) and `w2` (down)."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from engine.models.arch_config import ArchConfig
from engine.models.decoder import DecoderLayer
from engine.models.moe import MoECausalLM, SparseMoeBlock

_EXPERT_PROJECTIONS = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}
_MIXTRAL_EXPERT = re.compile(r"\.experts\.(\d+)\.(w[123])\.")


class MixtralDecoderLayer(DecoderLayer):
    """A Llama layer with a sparse MLP."""

    def build_mlp(self, config: ArchConfig, layer_index: int, dtype: torch.dtype) -> nn.Module:
        return SparseMoeBlock(config, dtype)


class MixtralForCausalLM(MoECausalLM):
    """Mixtral's mixtures of experts (top-2 of 8, weights renormalized)."""

    layer_class = MixtralDecoderLayer

    def checkpoint_tensors(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Mixtral's names as Qwen's and transformers 5's (`mlp.experts.{e}.gate_proj`, ...)."""
        return super().checkpoint_tensors((_common_name(name), tensor) for name, tensor in weights)


def _common_name(name: str) -> str:
    name = name.replace(".block_sparse_moe.", ".mlp.")
    return _MIXTRAL_EXPERT.sub(lambda m: f".experts.{m.group(1)}.{_EXPERT_PROJECTIONS[m.group(2)]}.", name)
