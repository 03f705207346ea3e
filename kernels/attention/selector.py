"""Picks the attention backend: by name (tests, benchmarks), $RAYPAGE_ATTENTION_BACKEND, or the default.

The default is `cpu_paged` (the C++ decode kernel over blocks in place) when its library loads, and
`sdpa` (plain torch over gathered blocks) when it cannot be built here; like vLLM's
VLLM_ATTENTION_BACKEND, the environment variable overrides the default for every worker it reaches.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

from kernels.attention.cpu_paged import cpu_paged_attention
from kernels.attention.metadata import AttentionMetadata
from kernels.attention.reference import reference_attention
from kernels.attention.sdpa import sdpa_attention
from kernels.build import cpu_kernels_available

# (query, key, value, kv_cache, metadata, scale) -> attention output; writes key/value to the cache.
AttentionBackend = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata, float], torch.Tensor
]

BACKEND_ENV = "RAYPAGE_ATTENTION_BACKEND"

_BACKENDS: dict[str, AttentionBackend] = {
    "cpu_paged": cpu_paged_attention,
    "reference": reference_attention,
    "sdpa": sdpa_attention,
}


def get_attention_backend(name: str | None = None) -> AttentionBackend:
    """The named backend, else $RAYPAGE_ATTENTION_BACKEND's, else `cpu_paged` (or `sdpa` without its kernel).

    `cpu_paged` asked for where its kernel cannot be built falls back to `sdpa`: serving never fails
    for a missing compiler (kernels.build logs why, once).
    """
    name = name or os.environ.get(BACKEND_ENV) or "cpu_paged"
    if name not in _BACKENDS:
        raise ValueError(
            f"unknown attention backend {name!r} (argument or ${BACKEND_ENV}); "
            f"available: {', '.join(sorted(_BACKENDS))}"
        )
    if name == "cpu_paged" and not cpu_kernels_available():
        name = "sdpa"
    return _BACKENDS[name]
