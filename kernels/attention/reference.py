"""Paged attention written for clarity: one sequence at a time, explicit softmax in float32.

The other backends are tested against this one; it is slow and never used for serving.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kernels.attention.metadata import AttentionMetadata
from kernels.cache_ops import gather_blocks, reshape_and_cache_torch


def reference_attention(
    query: Tensor, key: Tensor, value: Tensor, kv_cache: Tensor, meta: AttentionMetadata, scale: float
) -> Tensor:
    """Causal attention of each new token over its sequence's cached context and itself."""
    reshape_and_cache_torch(key, value, kv_cache, meta.slot_mapping)
    num_heads, num_kv_heads = query.shape[1], kv_cache.shape[1]
    out = torch.empty_like(query)
    for i in range(meta.num_seqs):
        start, end = meta.query_start_loc[i], meta.query_start_loc[i + 1]
        seq_len = meta.seq_lens_list[i]
        num_blocks = -(-seq_len // meta.block_size)
        keys, values = gather_blocks(kv_cache, meta.block_table[i, :num_blocks])[:, :, :seq_len].float()
        keys = keys.repeat_interleave(num_heads // num_kv_heads, dim=0)  # [heads, seq_len, dim]
        values = values.repeat_interleave(num_heads // num_kv_heads, dim=0)
        q = query[start:end].float()
        scores = torch.einsum("qhd,hkd->hqk", q, keys) * scale
        # Query row r sits at absolute position context + r and sees keys 0..context + r.
        context = seq_len - (end - start)
        positions = torch.arange(end - start, device=query.device).unsqueeze(1) + context
        visible = torch.arange(seq_len, device=query.device).unsqueeze(0) <= positions
        scores = scores.masked_fill(~visible, float("-inf"))
        out[start:end] = torch.einsum("hqk,hkd->qhd", scores.softmax(dim=-1), values).to(query.dtype)
    return out
