"""A decoder layer's RMS norm (with the residual add), rotary embedding and SiLU-and-multiply, and
the sampler's greedy argmax.

Each is written once in plain torch, what runs off the CPU (or without the compiled kernels), and
once in C++ (kernels/csrc/fused_ops.cpp) as one vectorized pass over the rows instead of two to ten
operators: at decode batch sizes the dispatch and memory passes of the torch version cost more than
its arithmetic. The C++ ops round where torch rounds, so bf16 results agree with torch's to the
last place but where a float32 sum's order or the exponential's last bit tips a rounding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from kernels.build import cpu_kernels_available

_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _fused(x: Tensor) -> bool:
    return x.is_cpu and x.dtype in _KERNEL_DTYPES and cpu_kernels_available()


def rms_norm_torch(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """weight * x / sqrt(mean(x²) + eps), the mean in float32 (Hugging Face Llama's order)."""
    if not _fused(x) or x.stride(-1) != 1 or weight.dtype != x.dtype:
        return rms_norm_torch(x, weight, eps)
    return torch.ops.raypage.rms_norm(x, weight, eps)


def add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """(rms_norm(x + residual), x + residual). The C++ path reuses both tensors' memory."""
    if not _fused(x) or not (x.is_contiguous() and residual.is_contiguous()) or weight.dtype != x.dtype:
        total = x + residual
        return rms_norm_torch(total, weight, eps), total
    torch.ops.raypage.fused_add_rms_norm(x, residual, weight, eps)
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


def silu_and_mul(x: Tensor) -> Tensor:
    """silu(gate) * up for x = [gate | up] ([..., 2d] -> [..., d]), each result rounded to x's dtype
    as F.silu's and the product's are."""
    if not _fused(x) or x.stride(-1) != 1:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
    return torch.ops.raypage.silu_and_mul(x)


def argmax_rows(logits: Tensor) -> Tensor:
    """The first index of each row's maximum ([rows, vocab] -> [rows] int64), NaN counting as the
    largest value (the first NaN wins), as torch's argmax and max(dim).indices answer."""
    if not _fused(logits) or logits.dim() != 2 or logits.stride(-1) != 1 or logits.shape[-1] == 0:
        # On the CPU `max(dim).indices`, not `argmax`: torch vectorizes the former for bf16 and
        # float16 but not the latter (docs/performance.md).
        return logits.max(dim=-1).indices if logits.is_cpu else logits.argmax(dim=-1)
    return torch.ops.raypage.argmax_rows(logits)
