"""Model-level layers that hold no sharded weights: norm, rotary embedding, paged attention."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from engine.forward_context import get_forward_context
from engine.models.rope import rope_angles
from kernels.attention import AttentionParams
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


class RotaryEmbedding(nn.Module):
    """Rotary position embedding in the "rotate half" layout Hugging Face Llama checkpoints use."""

    def __init__(
        self,
        head_dim: int,
        max_position: int,
        theta: float,
        scaling: dict[str, Any] | None,
        original_max_position: int | None = None,
    ) -> None:
        super().__init__()
        angles, factor = rope_angles(
            head_dim, theta, scaling, max_position, original_max_position or max_position
        )
        self.register_buffer("cos", angles.cos() * factor, persistent=False)
        self.register_buffer("sin", angles.sin() * factor, persistent=False)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate q [tokens, heads, dim] and k [tokens, kv_heads, dim] by their positions (maybe in place)."""
        return rotary_embedding(positions, q, k, self.cos, self.sin)


class PagedAttention(nn.Module):
    """Attention of one layer over the paged KV cache; the batch layout comes from the forward context."""

    def __init__(
        self,
        layer_index: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        scale: float | None = None,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
    ) -> None:
        super().__init__()
        self.layer_index = layer_index
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5 if scale is None else scale
        # A query at position p sees keys at p - sliding_window + 1 .. p (None: every earlier key).
        self.sliding_window = sliding_window
        # Scores become cap * tanh(score / cap) before the softmax (Gemma 2).
        self.logits_soft_cap = logits_soft_cap
        # What every backend call takes (made once: the layer's constants never change).
        self.params = AttentionParams(self.scale, sliding_window, logits_soft_cap)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        context = get_forward_context()
        out = context.attention_backend(
            q,
            k,
            v.view(-1, self.num_kv_heads, self.head_dim),
            context.kv_caches[self.layer_index],
            context.attn_metadata,
            self.params,
        )
        return out.reshape(-1, self.num_heads * self.head_dim)
