"""Model-level layers that hold no sharded weights: norm, rotary embedding, paged attention."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from engine.forward_context import get_forward_context
from kernels.fused_ops import add_rms_norm, rms_norm, rotary_embedding
from parallel.layers import default_weight_loader


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in float32; with a residual it adds first (fused pre-norm).

    kernels/fused_ops.py computes it: one C++ pass per row on the CPU, plain torch elsewhere.
    """

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)
        self.weight.weight_loader = default_weight_loader  # type: ignore[attr-defined]

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The norm of x, or of x + residual together with that sum (which may reuse both inputs)."""
        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        return add_rms_norm(x, residual, self.weight, self.eps)


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1's frequency-dependent rescaling of the rotary frequencies."""
    factor = scaling["factor"]
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding in the "rotate half" layout Hugging Face Llama checkpoints use."""

    def __init__(
        self, head_dim: int, max_position: int, theta: float, scaling: dict[str, Any] | None
    ) -> None:
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        positions = torch.arange(max_position, dtype=torch.int64).float()
        rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
        if rope_type == "linear":
            positions = positions / scaling["factor"]  # type: ignore[index]
        elif rope_type == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, scaling)  # type: ignore[arg-type]
        elif rope_type != "default":
            raise ValueError(
                f"rope scaling type {rope_type!r} is not supported (default, linear, llama3 are)"
            )
        freqs = torch.outer(positions, inv_freq)
        self.register_buffer("cos", freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin(), persistent=False)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate q [tokens, heads, dim] and k [tokens, kv_heads, dim] by their positions (maybe in place)."""
        return rotary_embedding(positions, q, k, self.cos, self.sin)


class PagedAttention(nn.Module):
    """Attention of one layer over the paged KV cache; the batch layout comes from the forward context."""

    def __init__(self, layer_index: int, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        super().__init__()
        self.layer_index = layer_index
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        context = get_forward_context()
        out = context.attention_backend(
            q,
            k,
            v.view(-1, self.num_kv_heads, self.head_dim),
            context.kv_caches[self.layer_index],
            context.attn_metadata,
            self.scale,
        )
        return out.reshape(-1, self.num_heads * self.head_dim)
