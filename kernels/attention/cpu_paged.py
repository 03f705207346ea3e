"""Paged attention on the CPU in C++ kernels that read the cache's blocks in place.

Which kernel attends which rows of a batch is decided in one place, `cpu_attention_path`, by the
table `CPU_ATTENTION_PATHS`: its rows are tried in order for the batch's decode rows and for its
prefill rows, and the first whose condition holds is taken.

| path           | taken where                                                                        |
| -------------- | ---------------------------------------------------------------------------------- |
| sdpa           | the tensors are off the CPU                                                        |
| int8           | an int8 cache (kv_cache_dtype="int8")                                              |
| amx            | a plain layer; amx_serves: a bf16 cache, AMX-BF16, a head and block size it serves |
| cascade_decode | decode rows of a plain layer; tiled_serves, and cascade_blocks: a shared prefix    |
| paged_decode   | every other decode row                                                             |
| tiled_prefill  | prefill rows; tiled_serves: a bf16 cache, AVX-512 BF16, a shape it is built for    |
| sdpa_prefill   | every other prefill row (other dtypes, CPUs and shapes)                            |

sdpa, int8 and amx take the whole batch, decodes and prefill chunks in one; the others one kind of
row. A plain layer has neither a sliding window nor a soft cap (`AttentionParams.plain`): int8,
paged_decode, tiled_prefill and the sdpa paths honour both natively, the decode and int8 kernels
starting at the block that holds each row's first visible key; amx and cascade_decode are for plain
layers only.

- sdpa: the sdpa backend (kernels/attention/sdpa.py), decodes in padded runs and SDPA per chunk.
- int8: `torch.ops.raypage.int8_paged_attention` (kernels/csrc/int8_attention.cpp), the only path
  that reads an int8 cache (its row format in kernels/cache_ops.py): one call for decodes and prefill
  chunks alike, each (sequence, KV head, run of query rows) an item that dequantizes every key and
  value row it reads once for the run's rows and the GQA group's heads, with a running softmax in
  float32. Half the bytes of a bf16 cache per token, for long contexts.
- amx: `torch.ops.raypage.amx_paged_attention` (kernels/csrc/amx_attention.cpp; head_dim 32, 64, 96
  or 128, blocks of a multiple of 16 tokens), one call for decodes and prefill chunks alike: a
  sequence's query rows and the query heads of a GQA group are the rows of matrix tiles, each causal
  to its own position, so a prefill chunk reads its context once per item of 128 rows instead of
  once per row; it beats the kernels below on prefill steps
  and on decodes with the cache in L3, and ties with them out of L3 (docs/performance.md, "AMX-BF16").
- cascade_decode: `torch.ops.raypage.cascade_decode_attention` (kernels/csrc/tiled_attention.cpp):
  each row attends to its own tokens past the shared prefix through the decode kernel, then the
  prefix's keys and values are read once for 16 rows at a time by the tiled kernel, and the two
  parts are merged by their softmax sums.
- paged_decode: `torch.ops.raypage.paged_decode_attention` (kernels/csrc/paged_attention.cpp), each
  (query row, KV head) pair over that row's blocks where they lie, so no padded copy of any
  sequence's keys and values is gathered per step. Inside, the kernel takes its `vdpbf16ps` loop
  for a bf16 cache on AVX-512 BF16 with head_dim 32, 64 or 128, GQA groups of 1-4, 6 or 8 and blocks
  of a multiple of 16 tokens, and its widening loop (AVX-512 or AVX2) for every other case.
- tiled_prefill: `torch.ops.raypage.tiled_prefill_attention` (kernels/csrc/tiled_attention.cpp),
  16 tokens of a chunk as the lanes of each vector, every key and value read once per 16 tokens
  where it lies; faster than running each prefill row through the decode kernel as a one-token
  sequence, which the backend did before (docs/performance.md, "Tiled prefill attention").
- sdpa_prefill: the sdpa backend's path, SDPA per chunk over a gathered copy of its context: where
  the decode kernel would widen every key for every row that reads it, SDPA per chunk wins.

`python -m benchmarks.bench_attention [--prefill] [--cold]` times these paths. The backend needs
`kernels.build.cpu_kernels_available()`; where the kernels cannot be built the selector hands out
the sdpa backend instead (kernels/attention/selector.py). A fused decoder layer
(engine/models/fused_layers.py, where the AMX kernel does not attend, the linears in panels or GGUF
blocks) makes the same decode and prefill choices in C++, from `cascade_blocks` here; where the
tiled kernel does not serve, only its steps of decode rows alone run fused.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Literal

import torch
from torch import Tensor

from kernels.attention.metadata import AttentionMetadata
from kernels.attention.params import AttentionParams
from kernels.attention.sdpa import decode_padded_runs, prefill_per_chunk, sdpa_attention
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


# Cascade attention pays only where enough decodes share enough tokens, and costs time below that
# (docs/performance.md, "raypage's own kernels").
CASCADE_MIN_DECODES = 16
CASCADE_MIN_SHARED_TOKENS = 128


def cascade_blocks(meta: AttentionMetadata) -> int:
    """How many shared leading blocks the decode rows should attend to together, once for all of
    them (0: none): where enough rows share enough blocks for it to pay. Needs the tiled kernel."""
    if meta.num_decodes < CASCADE_MIN_DECODES:
        return 0
    shared = meta.shared_decode_blocks
    return shared if shared * meta.block_size >= CASCADE_MIN_SHARED_TOKENS else 0


Rows = Literal["decode", "prefill"]


@dataclasses.dataclass(frozen=True)
class BatchRows:
    """What a path's condition reads: which rows of the batch are being routed, the batch, and how
    the layer attends."""

    rows: Rows
    query: Tensor
    kv_cache: Tensor
    meta: AttentionMetadata
    params: AttentionParams


@dataclasses.dataclass(frozen=True)
class CpuAttentionPath:
    """One row of CPU_ATTENTION_PATHS: a path's name, its condition in words, and the condition."""

    name: str
    when: str
    applies: Callable[[BatchRows], bool]


# Tried in order, first match wins; each `when` is its row of the module docstring's table.
CPU_ATTENTION_PATHS: tuple[CpuAttentionPath, ...] = (
    CpuAttentionPath("sdpa", "the tensors are off the CPU", lambda b: not b.query.is_cpu),
    CpuAttentionPath(
        "int8", 'an int8 cache (kv_cache_dtype="int8")', lambda b: b.kv_cache.dtype == torch.int8
    ),
    CpuAttentionPath(
        "amx",
        "a plain layer; amx_serves: a bf16 cache, AMX-BF16, a head and block size it serves",
        lambda b: b.params.plain and amx_serves(b.kv_cache),
    ),
    CpuAttentionPath(
        "cascade_decode",
        "decode rows of a plain layer; tiled_serves, and cascade_blocks: a shared prefix",
        lambda b: (
            b.rows == "decode"
            and b.params.plain
            and tiled_serves(b.query, b.kv_cache)
            and cascade_blocks(b.meta) > 0
        ),
    ),
    CpuAttentionPath("paged_decode", "every other decode row", lambda b: b.rows == "decode"),
    CpuAttentionPath(
        "tiled_prefill",
        "prefill rows; tiled_serves: a bf16 cache, AVX-512 BF16, a shape it is built for",
        lambda b: b.rows == "prefill" and tiled_serves(b.query, b.kv_cache),
    ),
    CpuAttentionPath(
        "sdpa_prefill",
        "every other prefill row (other dtypes, CPUs and shapes)",
        lambda b: b.rows == "prefill",
    ),
)


def cpu_attention_path(
    rows: Rows, query: Tensor, kv_cache: Tensor, meta: AttentionMetadata, params: AttentionParams
) -> str:
    """The name of the path that attends the batch's `rows` (the first row of CPU_ATTENTION_PATHS
    whose condition holds); "sdpa", "int8" and "amx" take the whole batch."""
    batch = BatchRows(rows, query, kv_cache, meta, params)
    return next(path.name for path in CPU_ATTENTION_PATHS if path.applies(batch))


def _int8_attention(
    out: Tensor,
    query: Tensor,
    kv_cache: Tensor,
    meta: AttentionMetadata,
    params: AttentionParams,
    num_seqs: int,
) -> None:
    """The batch's first `num_seqs` sequences over an int8 cache, in one call."""
    torch.ops.raypage.int8_paged_attention(
        out,
        query,
        kv_cache,
        meta.block_table[:num_seqs],
        meta.seq_lens[:num_seqs],
        meta.query_start_loc_tensor[: num_seqs + 1],
        params.scale,
        window=params.window_or_zero,
        soft_cap=params.soft_cap_or_zero,
    )


def _int8_decodes(
    out: Tensor, query: Tensor, kv_cache: Tensor, meta: AttentionMetadata, params: AttentionParams
) -> None:
    _int8_attention(out, query, kv_cache, meta, params, meta.num_decodes)


def _amx_decodes(
    out: Tensor, query: Tensor, kv_cache: Tensor, meta: AttentionMetadata, params: AttentionParams
) -> None:
    num_decodes = meta.num_decodes
    starts = meta.query_start_loc_tensor[: num_decodes + 1]  # 0, 1, ...: one row per decode
    torch.ops.raypage.amx_paged_attention(
        out,
        query,
        kv_cache,
        meta.block_table[:num_decodes],
        meta.seq_lens[:num_decodes],
        starts,
        params.scale,
    )


def _cascade_decodes(
    out: Tensor, query: Tensor, kv_cache: Tensor, meta: AttentionMetadata, params: AttentionParams
) -> None:
    num_decodes = meta.num_decodes
    torch.ops.raypage.cascade_decode_attention(
        out,
        query,
        kv_cache,
        meta.block_table[:num_decodes],
        meta.seq_lens[:num_decodes],
        cascade_blocks(meta),
        params.scale,
    )


def _paged_decodes(
    out: Tensor, query: Tensor, kv_cache: Tensor, meta: AttentionMetadata, params: AttentionParams
) -> None:
    num_decodes = meta.num_decodes
    torch.ops.raypage.paged_decode_attention(
        out,
        query,
        kv_cache,
        meta.block_table[:num_decodes],
        meta.seq_lens[:num_decodes],
        params.scale,
        window=params.window_or_zero,
        soft_cap=params.soft_cap_or_zero,
    )


# The decode rows' paths: (out, query, kv_cache, meta, params) over the batch's leading decode rows.
_DECODE_PATHS: dict[str, Callable[[Tensor, Tensor, Tensor, AttentionMetadata, AttentionParams], None]] = {
    "sdpa": decode_padded_runs,
    "int8": _int8_decodes,
    "amx": _amx_decodes,
    "cascade_decode": _cascade_decodes,
    "paged_decode": _paged_decodes,
}


def _tiled_prefills(
    out: Tensor,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    kv_cache: Tensor,
    meta: AttentionMetadata,
    params: AttentionParams,
) -> None:
    decodes = meta.num_decodes
    # The decodes' offsets sliced off: each prefill sequence's rows, as rows of `query`.
    torch.ops.raypage.tiled_prefill_attention(
        out,
        query,
        kv_cache,
        meta.block_table[decodes:],
        meta.seq_lens[decodes:],
        meta.query_start_loc_tensor[decodes:],
        params.scale,
        window=params.window_or_zero,
        soft_cap=params.soft_cap_or_zero,
    )


# The prefill rows' paths: (out, query, key, value, kv_cache, meta, params) over the whole batch's
# tensors, writing the prefill rows of `out`.
_PREFILL_PATHS: dict[
    str, Callable[[Tensor, Tensor, Tensor, Tensor, Tensor, AttentionMetadata, AttentionParams], None]
] = {
    "tiled_prefill": _tiled_prefills,
    "sdpa_prefill": prefill_per_chunk,
}


def decode_in_place(
    out: Tensor, query: Tensor, kv_cache: Tensor, meta: AttentionMetadata, params: AttentionParams
) -> None:
    """The decode rows alone (query[:num_decodes]) into `out`, by the path the table picks for them
    (python -m benchmarks.bench_attention times this)."""
    path = cpu_attention_path("decode", query, kv_cache, meta, params)
    _DECODE_PATHS[path](out, query, kv_cache, meta, params)


def cpu_paged_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    kv_cache: Tensor,
    meta: AttentionMetadata,
    params: AttentionParams,
) -> Tensor:
    """Needs `kernels.build.cpu_kernels_available()` first, for tensors on the CPU."""
    decode_path = cpu_attention_path("decode", query, kv_cache, meta, params)
    if decode_path == "sdpa":
        return sdpa_attention(query, key, value, kv_cache, meta, params)
    reshape_and_cache(key, value, kv_cache, meta.slot_mapping)
    out = torch.empty_like(query)
    if decode_path == "int8":
        _int8_attention(out, query, kv_cache, meta, params, meta.num_seqs)
        return out
    if decode_path == "amx":
        torch.ops.raypage.amx_paged_attention(
            out, query, kv_cache, meta.block_table, meta.seq_lens, meta.query_start_loc_tensor, params.scale
        )
        return out
    decodes = meta.num_decodes
    if decodes:
        _DECODE_PATHS[decode_path](out[:decodes], query[:decodes], kv_cache, meta, params)
    if decodes < meta.num_seqs:
        prefill_path = cpu_attention_path("prefill", query, kv_cache, meta, params)
        _PREFILL_PATHS[prefill_path](out, query, key, value, kv_cache, meta, params)
    return out
