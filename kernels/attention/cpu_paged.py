"""Paged attention in C++ kernels that read the cache's blocks in place.

Where the CPU has AMX-BF16 and the cache is bf16 (head_dim 32, 64, 96 or 128, blocks of a multiple
of 16 tokens), `torch.ops.raypage.amx_paged_attention` (kernels/csrc/amx_attention.cpp) attends the
whole batch in one call, decodes and prefill chunks alike: a sequence's query rows and the query
heads of a GQA group are the rows of matrix tiles, each causal to its own position, so a prefill
chunk reads its context once per item of 128 rows instead of once per row. On SmolLM2's shapes it
beat the kernel below 2-6x on prefill steps, 1.2x on decodes with the cache in L3 and tied with it
out of L3 (`python -m kernels.bench_attention [--prefill] [--cold]`).

Elsewhere decode rows take `torch.ops.raypage.paged_decode_attention` (kernels/csrc/paged_attention.cpp,
compiled by kernels/build.py), which attends each (query row, KV head) pair over that row's blocks
where they lie, so no padded copy of any sequence's keys and values is gathered per step. Prefill
chunks of a bf16 cache on a CPU with AVX-512 BF16 take `torch.ops.raypage.tiled_prefill_attention`
(kernels/csrc/tiled_attention.cpp): 16 tokens of a chunk as the lanes of each vector, every key and
value read once per 16 tokens where it lies; on SmolLM2's shapes 1.8-2.4x faster than running each
prefill row through the decode kernel as a one-token sequence, which the backend did before
(`python -m kernels.bench_attention --prefill`). Other prefill chunks (other dtypes and CPUs, shapes
the kernels are not built for) take the sdpa backend's path, SDPA per chunk over a gathered copy of
its context, and only decode rows the C++ kernel. Tensors off the CPU take the sdpa backend.

Decode rows that share a long prompt prefix (the same leading blocks, through the prefix cache) take
`torch.ops.raypage.cascade_decode_attention` where the tiled kernel serves: each row attends to its
own tokens past the prefix through the decode kernel, then the prefix's keys and values are read
once for 16 rows at a time by the tiled kernel, and the two parts are merged by their softmax sums.
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


def tiled_serves(query: Tensor, kv_cache: Tensor) -> bool:
    """Whether the tiled prefill kernel attends over this cache: bf16, on a CPU with AVX-512 BF16,
    a head size, GQA group and block size it is built for."""
    return kv_cache.dtype == torch.bfloat16 and _tiled_serves_shape(
        kv_cache.shape[-1], query.shape[1] // kv_cache.shape[1], kv_cache.shape[-2]
    )


@functools.cache
def _tiled_serves_shape(head_dim: int, group: int, block_size: int) -> bool:
    return torch.ops.raypage.tiled_attention_serves(head_dim, group, block_size)


# Cascade attention (tiled_attention.cpp) paid from about 16 decodes sharing 128 tokens, 1.5x at 64
# sharing 384, and cost up to 1.7x below (docs/performance.md, "raypage's own kernels").
CASCADE_MIN_DECODES = 16
CASCADE_MIN_SHARED_TOKENS = 128


def cascade_blocks(meta: AttentionMetadata) -> int:
    """How many shared leading blocks the decode rows should attend to together, once for all of
    them (0: none): where enough rows share enough blocks for it to pay. Needs the tiled kernel."""
    if meta.num_decodes < CASCADE_MIN_DECODES:
        return 0
    shared = meta.shared_decode_blocks
    return shared if shared * meta.block_size >= CASCADE_MIN_SHARED_TOKENS else 0


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
    elif tiled_serves(query, kv_cache) and (shared := cascade_blocks(meta)):
        torch.ops.raypage.cascade_decode_attention(out, query, kv_cache, block_table, seq_lens, shared, scale)
    else:
        torch.ops.raypage.paged_decode_attention(out, query, kv_cache, block_table, seq_lens, scale)


def cpu_paged_attention(
    query: Tensor, key: Tensor, value: Tensor, kv_cache: Tensor, meta: AttentionMetadata, scale: float
) -> Tensor:
    """Needs `kernels.build.cpu_kernels_available()` first, for tensors on the CPU."""
    if not query.is_cpu:
        return sdpa_attention(query, key, value, kv_cache, meta, scale)
    amx = amx_serves(kv_cache)
    prefills = meta.num_decodes < meta.num_seqs
    if not amx and prefills and not tiled_serves(query, kv_cache):
        return paged_attention(query, key, value, kv_cache, meta, scale, decode_in_place)
    reshape_and_cache(key, value, kv_cache, meta.slot_mapping)
    out = torch.empty_like(query)
    if amx:
        torch.ops.raypage.amx_paged_attention(
            out, query, kv_cache, meta.block_table, meta.seq_lens, meta.query_start_loc_tensor, scale
        )
        return out
    decodes = meta.num_decodes
    if decodes:
        decode_in_place(out[:decodes], query[:decodes], kv_cache, meta, scale)
    if prefills:  # the decodes' offsets sliced off: each prefill sequence's rows, as rows of `query`
        torch.ops.raypage.tiled_prefill_attention(
            out,
            query,
            kv_cache,
            meta.block_table[decodes:],
            meta.seq_lens[decodes:],
            meta.query_start_loc_tensor[decodes:],
            scale,
        )
    return out
