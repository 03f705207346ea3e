"""Paged attention fast enough to serve on a CPU, in plain torch.

Decodes (one query token each) are batched in runs of similar length: each run's blocks are
gathered with one `index_select` into a padded [kv_heads, seqs, tokens, dim] tensor and attended
with two batched matmuls, the query heads that share a KV head standing in as that head's rows. Prefill chunks go one sequence at a time
through `scaled_dot_product_attention`; a chunk with no cached context attends over its own keys
with `is_causal`, without reading the cache.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
from torch import Tensor

from kernels.attention.metadata import AttentionMetadata
from kernels.cache_ops import gather_blocks, reshape_and_cache


def sdpa_attention(
    query: Tensor, key: Tensor, value: Tensor, kv_cache: Tensor, meta: AttentionMetadata, scale: float
) -> Tensor:
    """Store the new keys and values, attend the decode rows in padded runs, then each prefill chunk."""
    reshape_and_cache(key, value, kv_cache, meta.slot_mapping)
    out = torch.empty_like(query)
    if meta.num_decodes:
        decode_padded_runs(out[: meta.num_decodes], query[: meta.num_decodes], kv_cache, meta, scale)
    prefill_per_chunk(out, query, key, value, kv_cache, meta, scale)
    return out


def prefill_per_chunk(
    out: Tensor,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    kv_cache: Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> None:
    """Each prefill chunk's rows of `out` through SDPA, one sequence at a time; the new keys and
    values must be in the cache already."""
    for i in range(meta.num_decodes, meta.num_seqs):
        start, end = meta.query_start_loc[i], meta.query_start_loc[i + 1]
        out[start:end] = _prefill(query, key, value, kv_cache, meta, i, scale)


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
    out: Tensor, query: Tensor, kv_cache: Tensor, meta: AttentionMetadata, scale: float
) -> None:
    """One query token per sequence, in runs of similar length (the model runner sorts decodes)."""
    lens = meta.seq_lens_list[: meta.num_decodes]
    if any(a < b for a, b in itertools.pairwise(lens)):
        raise ValueError("decode rows must come sorted by sequence length, longest first")
    for start, end in decode_chunks(lens, meta.block_size, DECODE_CHUNK_BLOCKS):
        num_blocks = -(-lens[start] // meta.block_size)
        out[start:end] = _decode_padded(
            query[start:end],
            kv_cache,
            meta.block_table[start:end, :num_blocks],
            meta.seq_lens[start:end],
            scale,
        )


def _decode_padded(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Decode rows padded to a common length, attended with two batched matmuls.

    Plain matmuls beat SDPA here: its CPU kernel is built for long query blocks, not 1-token rows.
    The query heads that share a KV head stand in as that head's rows. Scores are rounded to the
    cache dtype before the float32 softmax, as transformers' eager attention does.
    """
    num_seqs, num_heads, head_dim = query.shape
    num_kv_heads = kv_cache.shape[1]
    keys, values = gather_blocks(kv_cache, block_table)
    keys = keys.view(num_kv_heads, num_seqs, -1, head_dim).to(query.dtype)
    values = values.view(num_kv_heads, num_seqs, -1, head_dim).to(query.dtype)
    # [kv_heads, seqs, group, dim]
    grouped = query.view(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim).transpose(0, 1)
    scores = torch.matmul(grouped, keys.transpose(-1, -2)).float() * scale
    padding = torch.arange(keys.shape[2], device=query.device) >= seq_lens.unsqueeze(1)
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
    # A leading batch dimension: with 3-D inputs SDPA falls back to its slow reference path on the CPU.
    q = query[start:end].transpose(0, 1).unsqueeze(0)
    if seq_len == query_len:  # no cached context: this chunk's own keys are all there is
        k, v = key[start:end].transpose(0, 1).unsqueeze(0), value[start:end].transpose(0, 1).unsqueeze(0)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
        return out[0].transpose(0, 1)
    num_blocks = -(-seq_len // meta.block_size)
    k, v = (
        gather_blocks(kv_cache, meta.block_table[index, :num_blocks])[:, :, :seq_len].to(q.dtype).unsqueeze(1)
    )
    # Bottom-right causal mask: query row r sits at position context + r.
    context = seq_len - query_len
    mask = torch.ones(query_len, seq_len, dtype=torch.bool, device=query.device).tril(diagonal=context)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)
