"""A decoder layer's RMS norm (with the residual add) and rotary embedding.

Each is written once in plain torch, the reference every path is tested against and what runs off
the CPU, and once in C++ (kernels/csrc/fused_ops.cpp) as one pass over the rows instead of five to
ten operators: at decode batch sizes the dispatch and memory passes of the torch version cost more
than its arithmetic. The C++ ops round where torch rounds, so bf16 results agree bit for bit.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kernels.build import cpu_kernels_available


def _fused(x: Tensor) -> bool:
    return x.is_cpu and cpu_kernels_available()


def rms_norm_torch(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """weight * x / sqrt(mean(x²) + eps), the mean in float32 (Hugging Face Llama's order)."""
    if not _fused(x) or x.stride(-1) != 1:
        return rms_norm_torch(x, weight, eps)
    out = torch.empty_like(x)
    torch.ops.raypage.rms_norm(out.view(-1, x.shape[-1]), x.view(-1, x.shape[-1]), weight, eps)
    return out


def add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """(rms_norm(x + residual), x + residual). The C++ path reuses both tensors' memory."""
    if not _fused(x) or not (x.is_contiguous() and residual.is_contiguous()):
        total = x + residual
        return rms_norm_torch(total, weight, eps), total
    torch.ops.raypage.fused_add_rms_norm(x.view(-1, x.shape[-1]), residual.view(-1, x.shape[-1]), weight, eps)
    return x, residual


def _rotate_torch(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def rotary_embedding(
    positions: Tensor, q: Tensor, k: Tensor, cos: Tensor, sin: Tensor
) -> tuple[Tensor, Tensor]:
    """q [tokens, heads, dim] and k [tokens, kv_heads, dim] rotated by their positions' angles in the
    "rotate half" layout; cos and sin are float32 [positions, dim / 2]. The C++ path rotates in place."""
    if not _fused(q) or q.stride(-1) != 1 or k.stride(-1) != 1:
        cos, sin = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
        return _rotate_torch(q, cos, sin), _rotate_torch(k, cos, sin)
    torch.ops.raypage.rotary_embedding(positions, q, k, cos, sin)
    return q, k
