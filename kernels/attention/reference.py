"""Paged attention written for clarity: one sequence at a time, explicit softmax in float32.

The other backends are tested against this one; it is slow and never used for serving.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kernels.attention.metadata import AttentionMetadata
from kernels.attention.params import AttentionParams, cap_scores, visible_keys
from kernels.cache_ops import gather_blocks, reshape_and_cache_torch


def reference_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    kv_cache: Tensor,
    meta: AttentionMetadata,
    params: AttentionParams,
) -> Tensor:
    """Causal attention of each new token over its sequence's cached context and itself (within the
    layer's window), scores scaled, then soft-capped."""
    reshape_and_cache_torch(key, value, kv_cache, meta.slot_mapping)
    num_heads, num_kv_heads = query.shape[1], kv_cache.shape[1]
    out = torch.empty_like(query)
    for i in range(meta.num_seqs):
        start, end = meta.query_start_loc[i], meta.query_start_loc[i + 1]
        seq_len = meta.seq_lens_list[i]
        # Query row r sits at absolute position context + r. Blocks before the one holding the
        # first row's first visible key are never read: a sliding window may have freed them.
        context = seq_len - (end - start)
        first_block = params.first_visible(context) // meta.block_size
        num_blocks = -(-seq_len // meta.block_size)
        keys, values = gather_blocks(kv_cache, meta.block_table[i, first_block:num_blocks]).float()
        first_key = first_block * meta.block_size
        keys = keys[:, : seq_len - first_key].repeat_interleave(num_heads // num_kv_heads, dim=0)
        values = values[:, : seq_len - first_key].repeat_interleave(num_heads // num_kv_heads, dim=0)
        scores = cap_scores(
            torch.einsum("qhd,hkd->hqk", query[start:end].float(), keys) * params.scale, params
        )
        positions = torch.arange(first_key, seq_len, device=query.device)
        scores = scores.masked_fill(
            ~visible_keys(positions[context - first_key :], positions, params), float("-inf")
        )
        out[start:end] = torch.einsum("hqk,hkd->qhd", scores.softmax(dim=-1), values).to(query.dtype)
    return out
