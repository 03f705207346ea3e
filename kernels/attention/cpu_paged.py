"""Paged attention in a C++ kernel that reads the cache's blocks in place, decodes and prefills alike.

`torch.ops.raypage.paged_decode_attention` (kernels/csrc/paged_attention.cpp, compiled by
kernels/build.py) attends each (query row, KV head) pair over that row's blocks where they lie, so no
padded copy of any sequence's keys and values is gathered per step. A prefill chunk's rows go through
the same kernel after the chunk's keys and values are stored: each row is a one-token sequence whose
length ends at its own position (`AttentionMetadata.rows_as_sequences`), which is causal attention
over the cached context and the chunk alike. One call covers the whole batch; per query row it beat
`scaled_dot_product_attention` per chunk 2-3x on 128-token prompts (docs/performance.md). Tensors off
the CPU take the sdpa backend.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kernels.attention.metadata import AttentionMetadata
from kernels.attention.sdpa import decode_padded_runs, sdpa_attention
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


def cpu_paged_attention(
    query: Tensor, key: Tensor, value: Tensor, kv_cache: Tensor, meta: AttentionMetadata, scale: float
) -> Tensor:
    """Needs `kernels.build.cpu_kernels_available()` first, for tensors on the CPU."""
    if not query.is_cpu:
        return sdpa_attention(query, key, value, kv_cache, meta, scale)
    reshape_and_cache(key, value, kv_cache, meta.slot_mapping)
    out = torch.empty_like(query)
    block_table, lengths = meta.rows_as_sequences
    torch.ops.raypage.paged_decode_attention(out, query, kv_cache, block_table, lengths, scale)
    return out
