"""Paged attention fast enough to serve on a CPU, in plain torch.

Decodes (one query token each) are batched: their blocks are gathered with one `index_select` into
a padded [kv_heads, seqs, tokens, dim] tensor and attended with two batched matmuls, the query heads
that share a KV head standing in as that head's rows. Prefill chunks go one sequence at a time
through `scaled_dot_product_attention`; a chunk with no cached context attends over its own keys
with `is_causal`, without reading the cache.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.attention.metadata import AttentionMetadata
from kernels.cache_ops import gather_blocks, reshape_and_cache


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

    Plain matmuls beat SDPA here: its CPU kernel is built for long query blocks, not 1-token rows.
    Scores are rounded to the cache dtype before the float32 softmax, as transformers' eager
    attention does.
    """
    num_seqs, num_heads, head_dim = query.shape
    num_kv_heads = kv_cache.shape[1]
    max_len = max(meta.seq_lens_list[:num_seqs])
    num_blocks = -(-max_len // meta.block_size)
    keys, values = gather_blocks(kv_cache, meta.block_table[:num_seqs, :num_blocks])
    keys = keys.view(num_kv_heads, num_seqs, -1, head_dim).to(query.dtype)
    values = values.view(num_kv_heads, num_seqs, -1, head_dim).to(query.dtype)
    # [kv_heads, seqs, group, dim]: each KV head's query heads are its rows.
    grouped = query.view(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim).transpose(0, 1)
    scores = torch.matmul(grouped, keys.transpose(-1, -2)).float() * scale
    padding = torch.arange(keys.shape[2], device=query.device) >= meta.seq_lens[:num_seqs].unsqueeze(1)
    scores.masked_fill_(padding.view(1, num_seqs, 1, -1), float("-inf"))
    out = torch.matmul(scores.softmax(dim=-1).to(query.dtype), values)
    return out.transpose(0, 1).reshape(num_seqs, num_heads, head_dim)


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
    k, v = gather_blocks(kv_cache, meta.block_table[index, :num_blocks])[:, :, :seq_len].to(q.dtype)
    # Bottom-right causal mask: query row r sits at position context + r.
    context = seq_len - query_len
    mask = torch.ones(query_len, seq_len, dtype=torch.bool, device=query.device).tril(diagonal=context)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    return out.transpose(0, 1)
