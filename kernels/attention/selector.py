"""Picks the attention backend for a device (or by name, for tests and benchmarks)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from kernels.attention.metadata import AttentionMetadata
from kernels.attention.reference import reference_attention
from kernels.attention.sdpa import sdpa_attention

# (query, key, value, kv_cache, metadata, scale) -> attention output; writes key/value to the cache.
AttentionBackend = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata, float], torch.Tensor
]

_BACKENDS: dict[str, AttentionBackend] = {"reference": reference_attention, "sdpa": sdpa_attention}


def get_attention_backend(name: str | None = None) -> AttentionBackend:
    """The named backend, or the default: torch SDPA over gathered blocks (CPU and CUDA alike)."""
    name = name or "sdpa"
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; available: {', '.join(sorted(_BACKENDS))}")
    return _BACKENDS[name]
