"""Paged attention in C++ kernels that read the cache's blocks in place.

Where the CPU has AMX-BF16 and the cache is bf16 (head_dim 32, 64, 96 or 128, blocks of a multiple
of 16 tokens), `torch.ops.raypage.amx_paged_attention` (kernels/csrc/amx_attention.cpp) attends the
whole batch in one call, decodes and prefill chunks alike: a sequence's query rows and the query
heads of a GQA group are the rows of matrix tiles, each causal to its own position, so a prefill
chunk reads its context once per item of 128 rows instead of once per row. On SmolLM2's shapes it
beat the kernel below 2-6x on prefill steps, 1.2x on decodes with the cache in L3 and tied with it
out of L3 (`python -m kernels.bench_attention [--prefill] [--cold]`).

Elsewhere `torch.ops.raypage.paged_decode_attention` (kernels/csrc/paged_attention.cpp, compiled by
kernels/build.py) attends each (query row, KV head) pair over that row's blocks where they lie, so no
padded copy of any sequence's keys and values is gathered per step. Prefill rows take that kernel too
where it multiplies bf16 pairs natively (AVX-512 BF16, a bf16 cache): after the chunk's keys and
values are stored, each row is a one-token sequence whose length ends at its own position
(`AttentionMetadata.rows_as_sequences`), which is causal attention over the cached context and the
chunk alike, one call for the whole batch. There it beat `scaled_dot_product_attention` per chunk
2-6x. Elsewhere the kernel widens every key to float32 for every row that reads it, and SDPA's
blocked matmuls per chunk were 1.2-1.7x faster (an AVX2 Zen 3; docs/performance.md), so prefill
chunks take the sdpa backend's path and only decode rows the kernel. Tensors off the CPU take the
sdpa backend.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from kernels.attention.metadata import AttentionMetadata
from kernels.attention.sdpa import decode_padded_runs, paged_attention, sdpa_attention
from kernels.cache_ops import reshape_and_cache


def amx_serves(kv_cache: Tensor) -> bool:
    """Whether the AMX kernel attends over this cache: bf16, on a CPU with AMX-BF16, a head size and
    block size it is built for."""
    return kv_cache.dtype == torch.bfloat16 and _amx_serves_shape(kv_cache.shape[-1], kv_cache.shape[-2])


@functools.cache
def _amx_serves_shape(head_dim: int, block_size: int) -> bool:
    return torch.ops.raypage.amx_attention_serves(head_dim, block_size)


def decode_in_place(
    out: Tensor, query: Tensor, kv_cache: Tensor, meta: AttentionMetadata, scale: float
) -> None:
    """Decode rows alone through the C++ kernels (python -m kernels.bench_attention times this)."""
    if not query.is_cpu:
        decode_padded_runs(out, query, kv_cache, meta, scale)
        return
    num_decodes = meta.num_decodes
    block_table, seq_lens = meta.block_table[:num_decodes], meta.seq_lens[:num_decodes]
    if amx_serves(kv_cache):
        starts = meta.query_start_loc_tensor[: num_decodes + 1]  # 0, 1, ...: one row per decode
        torch.ops.raypage.amx_paged_attention(out, query, kv_cache, block_table, seq_lens, starts, scale)
    else:
        torch.ops.raypage.paged_decode_attention(out, query, kv_cache, block_table, seq_lens, scale)


@functools.cache
def prefills_through_kernel(dtype: torch.dtype) -> bool:
    """Whether prefill rows of a `dtype` cache are faster through the decode kernel than through SDPA."""
    return dtype == torch.bfloat16 and torch.ops.raypage.has_bf16_dot_product()


def cpu_paged_attention(
    query: Tensor, key: Tensor, value: Tensor, kv_cache: Tensor, meta: AttentionMetadata, scale: float
) -> Tensor:
    """Needs `kernels.build.cpu_kernels_available()` first, for tensors on the CPU."""
    if not query.is_cpu:
        return sdpa_attention(query, key, value, kv_cache, meta, scale)
    amx = amx_serves(kv_cache)
    if not amx and meta.num_decodes < query.shape[0] and not prefills_through_kernel(kv_cache.dtype):
        return paged_attention(query, key, value, kv_cache, meta, scale, decode_in_place)
    reshape_and_cache(key, value, kv_cache, meta.slot_mapping)
    out = torch.empty_like(query)
    if amx:
        torch.ops.raypage.amx_paged_attention(
            out, query, kv_cache, meta.block_table, meta.seq_lens, meta.query_start_loc_tensor, scale
        )
    else:
        block_table, lengths = meta.rows_as_sequences
        torch.ops.raypage.paged_decode_attention(out, query, kv_cache, block_table, lengths, scale)
    return out
