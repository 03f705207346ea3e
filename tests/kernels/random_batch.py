"""Random batches over a paged KV cache, for checking attention backends against the reference
(tests at small sizes, benchmarks/gpu_check.py at real ones)."""

from __future__ import annotations

import dataclasses

import torch

from kernels.attention.metadata import AttentionMetadata


@dataclasses.dataclass
class PagedBatch:
    """One step's inputs to an attention backend."""

    query: torch.Tensor  # [tokens, heads, head_dim]
    key: torch.Tensor  # [tokens, kv_heads, head_dim]
    value: torch.Tensor
    kv_cache: torch.Tensor  # [2, kv_heads, blocks, block_size, head_dim]
    meta: AttentionMetadata


def random_paged_batch(
    specs: list[tuple[int, int]],
    *,
    heads: int,
    kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    seed: int = 0,
) -> PagedBatch:
    """(context, query_len) per sequence, decodes (query_len 1) first as the model runner orders
    them. Each sequence gets scattered blocks of a random cache: its context is whatever the cache
    holds there, as after earlier steps; two spare blocks stay unused."""
    gen = torch.Generator().manual_seed(seed)
    widths = [-(-(context + query_len) // block_size) for context, query_len in specs]
    num_blocks = sum(widths) + 2
    free = torch.randperm(num_blocks, generator=gen).tolist()
    table = torch.zeros(len(specs), max(widths), dtype=torch.long)
    for i, width in enumerate(widths):
        table[i, :width] = torch.tensor([free.pop() for _ in range(width)])
    slots = [
        int(table[i, pos // block_size]) * block_size + pos % block_size
        for i, (context, query_len) in enumerate(specs)
        for pos in range(context, context + query_len)
    ]
    num_tokens = sum(query_len for _, query_len in specs)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(device, dtype)

    meta = specs_metadata(specs, table, slots, block_size, device)
    return PagedBatch(
        randn(num_tokens, heads, head_dim),
        randn(num_tokens, kv_heads, head_dim),
        randn(num_tokens, kv_heads, head_dim),
        randn(2, kv_heads, num_blocks, block_size, head_dim),
        meta,
    )


def specs_metadata(
    specs: list[tuple[int, int]],
    block_table: torch.Tensor,
    slots: list[int],
    block_size: int,
    device: torch.device | str,
) -> AttentionMetadata:
    """The metadata of a batch given as (context, query_len) per sequence, decodes first: the leading
    run of single-token sequences is the decode batch."""
    starts = [0]
    for _, query_len in specs:
        starts.append(starts[-1] + query_len)
    seq_lens = [context + query_len for context, query_len in specs]
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, device=device),
        block_table=block_table.to(device),
        seq_lens=torch.tensor(seq_lens, device=device),
        query_start_loc=starts,
        seq_lens_list=seq_lens,
        num_decodes=next((i for i, (_, q) in enumerate(specs) if q != 1), len(specs)),
        block_size=block_size,
    )
