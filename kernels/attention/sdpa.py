"""Paged attention on torch's scaled_dot_product_attention, fast enough to serve on a CPU.

Decodes (one query token each) are batched: their blocks are gathered into one padded tensor and
attended in a single call with a key-padding mask. Prefill chunks go one sequence at a time; a chunk
with no cached context attends over its own keys with `is_causal`, without touching the cache.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.attention.metadata import AttentionMetadata
from kernels.attention.reference import gather_sequence_kv
from kernels.cache_ops import reshape_and_cache


def sdpa_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    reshape_and_cache(key, value, kv_cache, meta.slot_mapping)
    out = torch.empty_like(query)
    if meta.num_decodes:
        out[: meta.num_decodes] = _decode(query[: meta.num_decodes], kv_cache, meta, scale)
    for i in range(meta.num_decodes, meta.num_seqs):
        start, end = meta.query_start_loc[i], meta.query_start_loc[i + 1]
        out[start:end] = _prefill(query, key, value, kv_cache, meta, i, scale)
    return out


def _decode(
    query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    """One query token per sequence, all sequences in one padded batch.

    The query heads that share a KV head are passed as that head's queries ([seqs, kv_heads,
    group, dim]): a decode token's mask is the same for all of them, and this avoids the much
    slower grouped-query path of SDPA.
    """
    num_seqs, num_heads, head_dim = query.shape
    num_kv_heads = kv_cache.shape[-2]
    max_len = max(meta.seq_lens_list[:num_seqs])
    num_blocks = -(-max_len // meta.block_size)
    # [2, seqs, blocks, block_size, kv_heads, dim] -> [2, seqs, kv_heads, tokens, dim]
    kv = kv_cache[:, meta.block_table[:num_seqs, :num_blocks]]
    keys, values = (
        kv.reshape(2, num_seqs, -1, num_kv_heads, head_dim)[:, :, :max_len].transpose(2, 3).unbind(0)
    )
    mask = torch.arange(max_len, device=query.device) < meta.seq_lens[:num_seqs].unsqueeze(1)
    out = F.scaled_dot_product_attention(
        query.view(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim),
        keys.to(query.dtype),
        values.to(query.dtype),
        attn_mask=mask.view(num_seqs, 1, 1, max_len),
        scale=scale,
    )
    return out.reshape(num_seqs, num_heads, head_dim)


def _prefill(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    index: int,
    scale: float,
) -> torch.Tensor:
    start, end = meta.query_start_loc[index], meta.query_start_loc[index + 1]
    seq_len, query_len = meta.seq_lens_list[index], end - start
    q = query[start:end].transpose(0, 1)
    if seq_len == query_len:  # no cached context: this chunk's own keys are all there is
        k, v = key[start:end].transpose(0, 1), value[start:end].transpose(0, 1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
        return out.transpose(0, 1)
    num_blocks = -(-seq_len // meta.block_size)
    k, v = (
        gather_sequence_kv(kv_cache, meta.block_table[index, :num_blocks], seq_len).transpose(1, 2).unbind(0)
    )
    # Bottom-right causal mask: query row r sits at position context + r.
    context = seq_len - query_len
    mask = torch.ones(query_len, seq_len, dtype=torch.bool, device=query.device).tril(diagonal=context)
    out = F.scaled_dot_product_attention(
        q, k.to(q.dtype), v.to(q.dtype), attn_mask=mask, scale=scale, enable_gqa=True
    )
    return out.transpose(0, 1)
