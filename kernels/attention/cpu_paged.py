"""Paged attention whose decode rows run in a C++ kernel that reads the cache's blocks in place.

`torch.ops.raypage.paged_decode_attention` (kernels/csrc/paged_attention.cpp, compiled by
kernels/build.py) attends each (sequence, KV head) pair over that sequence's blocks where they lie,
so no padded copy of any sequence's keys and values is gathered per step. Prefill chunks take the
same path as the sdpa backend. Tensors off the CPU take the sdpa backend's decode path.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kernels.attention.metadata import AttentionMetadata
from kernels.attention.sdpa import decode_padded_runs, paged_attention


def decode_in_place(
    out: Tensor, query: Tensor, kv_cache: Tensor, meta: AttentionMetadata, scale: float
) -> None:
    """The decode rows through the C++ kernel; needs `kernels.build.cpu_kernels_available()` first."""
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
    return paged_attention(query, key, value, kv_cache, meta, scale, decode_in_place)
