"""Paged attention fast enough to serve on a CPU, in plain torch.

Decodes (one query token each) are batched in runs of similar length: each run's blocks are
gathered with one `index_select` into a padded [kv_heads, seqs, tokens, dim] tensor and attended
with two batched matmuls, the query heads that share a KV head standing in as that head's rows. Prefill chunks go one sequence at a time
through `scaled_dot_product_attention`; a chunk with no cached context attends over its own keys
with `is_causal`, without reading the cache.

A layer with a sliding window gathers only the blocks from the one holding each row's first
visible key (the blocks before it may have been freed); a soft-capped layer's prefill chunks are
attended with explicit matmuls, since SDPA has no soft cap.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
from torch import Tensor

from kernels.attention.metadata import AttentionMetadata
from kernels.attention.params import AttentionParams, cap_scores, visible_keys
from kernels.cache_ops import gather_blocks, reshape_and_cache


def sdpa_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    kv_cache: Tensor,
    meta: AttentionMetadata,
    params: AttentionParams,
) -> Tensor:
    """Store the new keys and values, attend the decode rows in padded runs, then each prefill chunk."""
    reshape_and_cache(key, value, kv_cache, meta.slot_mapping)
    out = torch.empty_like(query)
    if meta.num_decodes:
        decode_padded_runs(out[: meta.num_decodes], query[: meta.num_decodes], kv_cache, meta, params)
    prefill_per_chunk(out, query, key, value, kv_cache, meta, params)
    return out


def prefill_per_chunk(
    out: Tensor,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    kv_cache: Tensor,
    meta: AttentionMetadata,
    params: AttentionParams,
) -> None:
    """Each prefill chunk's rows of `out` through SDPA, one sequence at a time; the new keys and
    values must be in the cache already."""
    for i in range(meta.num_decodes, meta.num_seqs):
        start, end = meta.query_start_loc[i], meta.query_start_loc[i + 1]
        out[start:end] = _prefill(query, key, value, kv_cache, meta, i, params)


# Most padded blocks one decode chunk gathers: about 6 MB of bf16 keys and values for a small
# model, so that the gathered tensor is still in cache when the matmuls read it.
DECODE_CHUNK_BLOCKS = 512


def decode_chunks(
    seq_lens: list[int], block_size: int, budget: int = DECODE_CHUNK_BLOCKS
) -> list[tuple[int, int]]:
    """Split decode rows, sorted by length, into [start, end) runs whose padded gather fits `budget`.

    Padding every sequence to the longest one in the batch wastes most of the work when lengths
    vary; runs of similar length waste little.
    """
    chunks, start, widest = [], 0, 0
    for end, seq_len in enumerate(seq_lens):
        blocks = -(-seq_len // block_size)
        widest = max(widest, blocks)
        if end > start and (end + 1 - start) * widest > budget:
            chunks.append((start, end))
            start, widest = end, blocks
    chunks.append((start, len(seq_lens)))
    return chunks


def decode_padded_runs(
    out: Tensor, query: Tensor, kv_cache: Tensor, meta: AttentionMetadata, params: AttentionParams
) -> None:
    """One query token per sequence, in runs of similar length (the model runner sorts decodes)."""
    lens = meta.seq_lens_list[: meta.num_decodes]
    if any(a < b for a, b in itertools.pairwise(lens)):
        raise ValueError("decode rows must come sorted by sequence length, longest first")
    block_size = meta.block_size
    if params.sliding_window is not None:
        # A window of w keys spans at most this many blocks, wherever it starts in its first one.
        span = (-(-(params.sliding_window - 1) // block_size) + 1) * block_size
        lens = [min(seq_len, span) for seq_len in lens]
    for start, end in decode_chunks(lens, block_size, DECODE_CHUNK_BLOCKS):
        out[start:end] = _decode_padded(
            query[start:end],
            kv_cache,
            meta.block_table[start:end],
            meta.seq_lens[start:end],
            -(-lens[start] // block_size),
            params,
        )


def _decode_padded(
    query: Tensor,
    kv_cache: Tensor,
    block_table: Tensor,
    seq_lens: Tensor,
    num_blocks: int,
    params: AttentionParams,
) -> Tensor:
    """Decode rows padded to `num_blocks` blocks each, from the block holding each row's first
    visible key, attended with two batched matmuls.

    Plain matmuls beat SDPA here: its CPU kernel is built for long query blocks, not 1-token rows.
    The query heads that share a KV head stand in as that head's rows. Scores are rounded to the
    cache dtype before the float32 softmax, as transformers' eager attention does.
    """
    num_seqs, num_heads, head_dim = query.shape
    num_kv_heads, block_size = kv_cache.shape[1], kv_cache.shape[3]
    positions = seq_lens - 1  # each row's query
    first_blocks = _first_visible(positions, params) // block_size
    offsets = torch.arange(num_blocks, device=query.device)
    # Columns past a row's last block (padding) are clamped into the table and masked below.
    columns = (first_blocks.unsqueeze(1) + offsets).clamp(max=block_table.shape[1] - 1)
    keys, values = gather_blocks(kv_cache, block_table.gather(1, columns))
    keys = keys.view(num_kv_heads, num_seqs, -1, head_dim).to(query.dtype)
    values = values.view(num_kv_heads, num_seqs, -1, head_dim).to(query.dtype)
    # [kv_heads, seqs, group, dim]
    grouped = query.view(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim).transpose(0, 1)
    scores = cap_scores(torch.matmul(grouped, keys.transpose(-1, -2)).float() * params.scale, params)
    key_positions = first_blocks.unsqueeze(1) * block_size + torch.arange(keys.shape[2], device=query.device)
    hidden = ~visible_keys(positions.unsqueeze(1), key_positions, params)  # [seqs, 1, keys]
    scores.masked_fill_(hidden.unsqueeze(0), float("-inf"))
    out = torch.matmul(scores.softmax(dim=-1).to(query.dtype), values)
    return out.transpose(0, 1).reshape(num_seqs, num_heads, head_dim)


def _first_visible(positions: Tensor, params: AttentionParams) -> Tensor:
    """AttentionParams.first_visible of each query position."""
    if params.sliding_window is None:
        return torch.zeros_like(positions)
    return (positions - params.sliding_window + 1).clamp(min=0)


def _prefill(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    kv_cache: Tensor,
    meta: AttentionMetadata,
    index: int,
    params: AttentionParams,
) -> Tensor:
    start, end = meta.query_start_loc[index], meta.query_start_loc[index + 1]
    seq_len, query_len = meta.seq_lens_list[index], end - start
    context = seq_len - query_len
    # A leading batch dimension: with 3-D inputs SDPA falls back to its slow reference path on the CPU.
    q = query[start:end].transpose(0, 1).unsqueeze(0)
    if seq_len == query_len:  # no cached context: this chunk's own keys are all there is
        k, v = key[start:end].transpose(0, 1).unsqueeze(0), value[start:end].transpose(0, 1).unsqueeze(0)
        first_key = 0
    else:
        first_block = params.first_visible(context) // meta.block_size
        first_key = first_block * meta.block_size
        num_blocks = -(-seq_len // meta.block_size)
        blocks = gather_blocks(kv_cache, meta.block_table[index, first_block:num_blocks])
        k, v = blocks[:, :, : seq_len - first_key].to(q.dtype).unsqueeze(1)
    key_positions = torch.arange(first_key, seq_len, device=query.device)
    return _attend(q, k, v, key_positions[context - first_key :], key_positions, params)[0].transpose(0, 1)


def _attend(
    q: Tensor, k: Tensor, v: Tensor, query_positions: Tensor, key_positions: Tensor, params: AttentionParams
) -> Tensor:
    """[1, heads, queries, dim] over [1, kv_heads, keys, dim]: SDPA, causal without a mask where the
    queries are the keys and nothing else applies; explicit matmuls with a soft cap."""
    if params.logits_soft_cap is not None:
        return _attend_capped(q, k, v, visible_keys(query_positions, key_positions, params), params)
    if params.sliding_window is None and len(query_positions) == len(key_positions):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=params.scale, enable_gqa=True)
    mask = visible_keys(query_positions, key_positions, params)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=params.scale, enable_gqa=True)


def _attend_capped(q: Tensor, k: Tensor, v: Tensor, visible: Tensor, params: AttentionParams) -> Tensor:
    """Attention with soft-capped scores (softmax in float32), the KV heads repeated for GQA."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = cap_scores(torch.matmul(q, k.transpose(-1, -2)).float() * params.scale, params)
    probs = scores.masked_fill(~visible, float("-inf")).softmax(dim=-1)
    return torch.matmul(probs.to(v.dtype), v)
