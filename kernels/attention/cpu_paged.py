"""Paged attention in a C++ kernel that reads the cache's blocks in place.

`torch.ops.raypage.paged_decode_attention` (kernels/csrc/paged_attention.cpp, compiled by
kernels/build.py) attends each (query row, KV head) pair over that row's blocks where they lie, so no
padded copy of any sequence's keys and values is gathered per step.

Prefill rows take the kernel too where it multiplies bf16 pairs natively (AVX-512 BF16, a bf16
cache): after the chunk's keys and values are stored, each row is a one-token sequence whose length
ends at its own position (`AttentionMetadata.rows_as_sequences`), which is causal attention over the
cached context and the chunk alike, one call for the whole batch. There it beat
`scaled_dot_product_attention` per chunk 2-6x. Elsewhere the kernel widens every key to float32 for
every row that reads it, and SDPA's blocked matmuls per chunk were 1.2-1.7x faster (an AVX2 Zen 3;
docs/performance.md), so prefill chunks take the sdpa backend's path and only decode rows the kernel.
Tensors off the CPU take the sdpa backend.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from kernels.attention.metadata import AttentionMetadata
from kernels.attention.sdpa import decode_padded_runs, paged_attention, sdpa_attention
from kernels.cache_ops import reshape_and_cache


def decode_in_place(
    out: Tensor, query: Tensor, kv_cache: Tensor, meta: AttentionMetadata, scale: float
) -> None:
    """Decode rows alone through the C++ kernel (python -m kernels.bench_attention times this)."""
    if not query.is_cpu:
        decode_padded_runs(out, query, kv_cache, meta, scale)
        return
    num_decodes = meta.num_decodes
    torch.ops.raypage.paged_decode_attention(
        out, query, kv_cache, meta.block_table[:num_decodes], meta.seq_lens[:num_decodes], scale
    )


@functools.cache
def prefills_through_kernel(dtype: torch.dtype) -> bool:
    """Whether prefill rows of a `dtype` cache are faster through the kernel than through SDPA."""
    return dtype == torch.bfloat16 and torch.ops.raypage.has_bf16_dot_product()


def cpu_paged_attention(
    query: Tensor, key: Tensor, value: Tensor, kv_cache: Tensor, meta: AttentionMetadata, scale: float
) -> Tensor:
    """Needs `kernels.build.cpu_kernels_available()` first, for tensors on the CPU."""
    if not query.is_cpu:
        return sdpa_attention(query, key, value, kv_cache, meta, scale)
    if meta.num_decodes < query.shape[0] and not prefills_through_kernel(kv_cache.dtype):
        return paged_attention(query, key, value, kv_cache, meta, scale, decode_in_place)
    reshape_and_cache(key, value, kv_cache, meta.slot_mapping)
    out = torch.empty_like(query)
    block_table, lengths = meta.rows_as_sequences
    torch.ops.raypage.paged_decode_attention(out, query, kv_cache, block_table, lengths, scale)
    return out
