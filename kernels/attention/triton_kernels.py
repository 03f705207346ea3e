"""Triton paged attention kernels: query rows over a sequence's keys and values read in place from
the paged cache through its block table (no gathered copy).

One kernel serves decodes (one new token per sequence), fresh prefills, chunks of a chunked prefill
and the new tokens after a prefix-cache hit: the step's keys and values are already in the cache
(reshape-and-cache runs first), so every key is read through the block table, the context fully
visible and the new tokens causal among themselves. A program takes BLOCK_Q new tokens of one
sequence for one KV head; the rows of its tile are those tokens times the query heads that share the
KV head (GQA without repeating K/V). It walks the keys up to its last token's position, KEY_TILE
tokens per step whatever the block size (each key's block looked up in the table), with an online
softmax in float32 (exp2, the scale folded into log2 units).

A sliding window (window > 0) starts a program's walk at the key tile holding its first token's
first visible key, and loads no key before that one (the blocks wholly before it may have been
freed); each row then masks the keys before its own window. A soft cap (SOFT_CAP) turns the scores
into cap * tanh(score / cap) before masking, in the same log2 units (cap * LOG2E is passed).

Split-K (vLLM's PagedAttention v2): with num_splits > 1 a program takes only its share of the
key tiles and leaves a partial output, its running maximum and its sum of exponentials; a second
kernel merges the splits. Decodes of a few long sequences then still fill the GPU. The share is
computed in the kernel from the sequence's length on the device, so the launch depends on no
host-side length beyond the grid.
"""

from __future__ import annotations

import math

import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

LOG2E = math.log2(math.e)


@triton.jit
def paged_attention_kernel(
    query_ptr,
    key_cache_ptr,
    value_cache_ptr,
    block_table_ptr,
    seq_lens_ptr,
    query_start_ptr,
    out_ptr,
    partial_out_ptr,
    partial_max_ptr,
    partial_sum_ptr,
    scale_log2,
    window,
    soft_cap_log2,
    first_seq,
    num_splits,
    stride_q_token,
    stride_q_head,
    stride_c_head,
    stride_table,
    stride_o_token,
    stride_o_head,
    NUM_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_POW2: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    KEY_TILE: tl.constexpr,
    SINGLE_SPLIT: tl.constexpr,
    FP32_DOT: tl.constexpr,
    SOFT_CAP: tl.constexpr,
):
    seq = first_seq + tl.program_id(0)
    tile = tl.program_id(1)
    kv_head = (tl.program_id(2) // num_splits).to(tl.int64)
    split = tl.program_id(2) % num_splits
    query_start = tl.load(query_start_ptr + seq).to(tl.int64)
    query_len = tl.load(query_start_ptr + seq + 1) - query_start
    seq_len = tl.load(seq_lens_ptr + seq)
    context = seq_len - query_len

    rows = tl.arange(0, BLOCK_Q * GROUP_POW2)
    tokens = tile * BLOCK_Q + rows // GROUP_POW2
    group = rows % GROUP_POW2
    heads = kv_head * GROUP + group
    dims = tl.arange(0, HEAD_DIM_PAD)
    row_mask = (tokens < query_len) & (group < GROUP)
    dim_mask = dims < HEAD_DIM
    q = tl.load(
        query_ptr
        + (query_start + tokens)[:, None] * stride_q_token
        + heads[:, None] * stride_q_head
        + dims[None, :],
        mask=row_mask[:, None] & dim_mask[None, :],
        other=0.0,
    )
    query_positions = context + tokens
    # Each row sees keys from its first visible one (its window's start, else 0) to its own.
    row_starts = tl.where(window > 0, query_positions - window + 1, 0)

    # Keys from the tile's first token's first visible one up to its last token (none for a tile
    # past this sequence's new tokens), in tiles of KEY_TILE tokens, this split's share of them.
    tile_end = tl.minimum(context + (tile + 1) * BLOCK_Q, seq_len)
    num_key_tiles = tl.where(tile * BLOCK_Q < query_len, tl.cdiv(tile_end, KEY_TILE), 0)
    window_start = tl.where(window > 0, tl.maximum(context + tile * BLOCK_Q - window + 1, 0), 0)
    start_key_tile = tl.minimum(window_start // KEY_TILE, num_key_tiles)
    tiles_per_split = tl.cdiv(num_key_tiles - start_key_tile, num_splits)
    first_key_tile = start_key_tile + split * tiles_per_split
    last_key_tile = tl.minimum(first_key_tile + tiles_per_split, num_key_tiles)

    running_max = tl.full([BLOCK_Q * GROUP_POW2], float("-inf"), tl.float32)
    running_sum = tl.zeros([BLOCK_Q * GROUP_POW2], tl.float32)
    acc = tl.zeros([BLOCK_Q * GROUP_POW2, HEAD_DIM_PAD], tl.float32)
    table_row = block_table_ptr + seq * stride_table
    for key_tile in range(first_key_tile, last_key_tile):
        positions = key_tile * KEY_TILE + tl.arange(0, KEY_TILE)
        in_seq = (positions < seq_len) & (positions >= window_start)
        # Each key's physical block, through the block table: a tile may span several blocks.
        blocks = tl.load(table_row + positions // BLOCK_SIZE, mask=in_seq, other=0).to(tl.int64)
        # The cache is contiguous: [kv_heads, blocks, BLOCK_SIZE, HEAD_DIM] per key/value half.
        kv_offsets = (
            kv_head * stride_c_head
            + (blocks * BLOCK_SIZE + positions % BLOCK_SIZE)[:, None] * HEAD_DIM
            + dims[None, :]
        )
        kv_mask = in_seq[:, None] & dim_mask[None, :]
        k = tl.load(key_cache_ptr + kv_offsets, mask=kv_mask, other=0.0)
        v = tl.load(value_cache_ptr + kv_offsets, mask=kv_mask, other=0.0)
        scores = _dot_f32(q, tl.trans(k.to(q.dtype)), FP32_DOT) * scale_log2
        if SOFT_CAP:
            scores = soft_cap_log2 * _tanh(scores / soft_cap_log2)
        # Causal: the context and the new tokens up to the row's own, inside its window if any.
        visible = (positions[None, :] <= query_positions[:, None]) & (
            positions[None, :] >= row_starts[:, None]
        )
        scores = tl.where(visible, scores, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, axis=1))
        # A row that has seen no visible key yet (possible in a split) keeps -inf; a finite stand-in
        # for it avoids -inf - -inf (NaN) and gives correction 0 and probabilities 0.
        safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)
        correction = tl.exp2(running_max - safe_max)
        probs = tl.exp2(scores - safe_max[:, None])
        running_sum = running_sum * correction + tl.sum(probs, axis=1)
        acc = acc * correction[:, None] + _dot_f32(probs.to(v.dtype), v, FP32_DOT)
        running_max = new_max

    if SINGLE_SPLIT:
        # Rows that saw no key (masked rows of a partial tile) are not stored.
        out = acc / tl.where(running_sum > 0, running_sum, 1.0)[:, None]
        tl.store(
            out_ptr
            + (query_start + tokens)[:, None] * stride_o_token
            + heads[:, None] * stride_o_head
            + dims[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=row_mask[:, None] & dim_mask[None, :],
        )
    else:
        # Partials are contiguous [tokens, heads, splits(, HEAD_DIM_PAD)].
        stat_offsets = ((query_start + tokens) * NUM_HEADS + heads) * num_splits + split
        tl.store(partial_max_ptr + stat_offsets, running_max, mask=row_mask)
        tl.store(partial_sum_ptr + stat_offsets, running_sum, mask=row_mask)
        tl.store(
            partial_out_ptr + stat_offsets[:, None] * HEAD_DIM_PAD + dims[None, :],
            acc,
            mask=row_mask[:, None],
        )


@triton.jit
def merge_splits_kernel(
    out_ptr,
    partial_out_ptr,
    partial_max_ptr,
    partial_sum_ptr,
    num_splits,
    stride_o_token,
    stride_o_head,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    SPLITS_POW2: tl.constexpr,
):
    token = tl.program_id(0)
    head = tl.program_id(1)
    splits = tl.arange(0, SPLITS_POW2)
    dims = tl.arange(0, HEAD_DIM_PAD)
    split_mask = splits < num_splits
    stat_offsets = (token * tl.num_programs(1) + head) * num_splits + splits
    # An empty split (a sequence shorter than the others) left max -inf and sum 0: weight 0 below.
    split_max = tl.load(partial_max_ptr + stat_offsets, mask=split_mask, other=float("-inf"))
    split_sum = tl.load(partial_sum_ptr + stat_offsets, mask=split_mask, other=0.0)
    split_out = tl.load(
        partial_out_ptr + stat_offsets[:, None] * HEAD_DIM_PAD + dims[None, :],
        mask=split_mask[:, None],
        other=0.0,
    )
    weights = tl.exp2(split_max - tl.max(split_max, axis=0))
    out = tl.sum(split_out * weights[:, None], axis=0) / tl.sum(split_sum * weights, axis=0)
    tl.store(
        out_ptr + token * stride_o_token + head * stride_o_head + dims,
        out.to(out_ptr.dtype.element_ty),
        mask=dims < HEAD_DIM,
    )


@triton.jit
def _tanh(x):
    """tanh from the sigmoid, which the interpreter and every GPU backend have."""
    return 2 * tl.sigmoid(2 * x) - 1


@triton.jit
def _dot_f32(a, b, FP32_DOT: tl.constexpr):
    """a @ b accumulated in float32. FP32_DOT multiplies in float32 too: the products of 16-bit
    inputs are exact there, as on the tensor cores, so it changes how, not what, is computed."""
    if FP32_DOT:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b)


def kernels_interpreted() -> bool:
    """Whether these kernels were made for Triton's interpreter (TRITON_INTERPRET=1 at import)."""
    return isinstance(paged_attention_kernel, InterpretedFunction)
