"""The Triton attention backend: reshape-and-cache, then the paged attention kernel
(kernels/attention/triton_kernels.py) launched twice, for the decodes (small tiles, split-K over long
contexts) and for the prefill chunks (wide tiles); the tile sizes and splits are chosen here.

Triton's kernels run on CUDA tensors, or on CPU tensors in Triton's interpreter when
TRITON_INTERPRET=1 was set before triton was imported (how the test suite runs them without a GPU).
`kernels.attention.selector` imports this module only when the backend is asked for.
"""

from __future__ import annotations

import functools

import torch
import triton
from torch import Tensor

from kernels.attention.metadata import AttentionMetadata
from kernels.attention.params import AttentionParams
from kernels.attention.triton_kernels import (
    LOG2E,
    kernels_interpreted,
    merge_splits_kernel,
    paged_attention_kernel,
)
from kernels.triton_cache import triton_reshape_and_cache

# The block sizes the kernels are made and tested for: powers of two >= 16, as vLLM's GPU backends.
MIN_BLOCK_SIZE = 16
# A split covers at least this many tokens: below it merging costs more than the parallelism gains.
MIN_SPLIT_TOKENS = 256
MAX_SPLITS = 32
# tl.dot needs every dimension of a tile to be at least 16 on the GPU.
MIN_DOT_DIM = 16
# Rows of a prefill program's tile (new tokens x query heads of a group): enough for the tensor cores.
TILE_ROWS = 64
# Keys per step of a program's loop, whatever the block size (wide loads and dots for small blocks),
# and warps per program: for a decode's 16 rows, and for a prefill's 64. Each key's address is its
# own (a tile spans blocks), so the tile's pointers take registers: on sm_90 with 128-dim heads in
# bf16 these stay under 255 registers a thread without spilling (cuobjdump -res-usage).
DECODE_KEY_TILE, DECODE_WARPS = 32, 4
PREFILL_KEY_TILE, PREFILL_WARPS = 64, 8


def triton_unavailable_reason(device: torch.device, block_size: int) -> str | None:
    """Why the Triton kernels cannot run on `device` with this block size; None when they can."""
    if block_size < MIN_BLOCK_SIZE or block_size & (block_size - 1):
        return f"block_size {block_size} is not a power of two >= {MIN_BLOCK_SIZE}"
    if device.type == "cuda":
        return None if torch.cuda.is_available() else "torch sees no CUDA device"
    if kernels_interpreted():
        return None
    if triton.knobs.runtime.interpret:
        return "TRITON_INTERPRET=1 was set after the Triton kernels were imported; set it before triton is"
    return (
        f"needs CUDA tensors, or TRITON_INTERPRET=1 (set before triton is imported) to run on "
        f"{device.type} tensors in Triton's interpreter"
    )


def triton_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    kv_cache: Tensor,
    meta: AttentionMetadata,
    params: AttentionParams,
) -> Tensor:
    """Store the new keys and values, then attend the decode rows and the prefill chunks."""
    triton_reshape_and_cache(key, value, kv_cache, meta.slot_mapping)
    out = torch.empty_like(query)
    num_decodes = meta.num_decodes
    rows = (out, query, kv_cache, meta.block_table, meta.seq_lens, meta.query_start_loc_tensor)
    if num_decodes:
        # The splits follow the block table's width (the batch's longest sequence, rounded up to a
        # block), never a host-side length: a captured decode graph's table is max_model_len wide
        # whatever the lengths it replays, so its grid stays right, and each split finds its share
        # from the lengths on the device.
        capacity = meta.block_table.shape[1] * kv_cache.shape[3]
        splits = decode_num_splits(num_decodes, kv_cache.shape[1], capacity, query.device)
        paged_attention_rows(*rows, range(num_decodes), 1, params, splits)
    if num_decodes < meta.num_seqs:
        prefills = range(num_decodes, meta.num_seqs)
        paged_attention_rows(*rows, prefills, max(meta.query_len(i) for i in prefills), params)
    return out


# The decode launch reads only device tensors and the table's shape: CUDA graphs may capture it.
triton_attention.cuda_graph_safe = True  # type: ignore[attr-defined]


def decode_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, device: torch.device) -> int:
    """How many splits each decode's blocks get: enough programs to fill the device, none shorter
    than MIN_SPLIT_TOKENS."""
    wanted = triton.cdiv(_target_programs(device), num_seqs * num_kv_heads)
    return max(1, min(wanted, triton.cdiv(max_seq_len, MIN_SPLIT_TOKENS), MAX_SPLITS))


@functools.cache
def _target_programs(device: torch.device) -> int:
    # Two waves of programs per streaming multiprocessor; the interpreter (on the CPU) has no such
    # count, and a few programs let the tests' longer decodes split.
    if device.type == "cuda":
        return 2 * torch.cuda.get_device_properties(device).multi_processor_count
    return 8


def attention_constants(
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    max_query_len: int,
    dtype: torch.dtype,
    num_splits: int,
) -> tuple[dict[str, int | bool], int]:
    """The attention kernel's compile-time constants and warps for one launch's shapes."""
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads cannot share {num_kv_heads} KV heads evenly")
    group = num_heads // num_kv_heads
    group_pow2 = triton.next_power_of_2(group)
    # TILE_ROWS rows, fewer for short queries (one token for decodes), never under MIN_DOT_DIM.
    block_q = min(max(1, TILE_ROWS // group_pow2), triton.next_power_of_2(max_query_len))
    block_q = max(block_q, triton.cdiv(MIN_DOT_DIM, group_pow2))
    small_tile = block_q * group_pow2 <= MIN_DOT_DIM
    constants = {
        "NUM_HEADS": num_heads,
        "GROUP": group,
        "GROUP_POW2": group_pow2,
        "HEAD_DIM": head_dim,
        "HEAD_DIM_PAD": max(MIN_DOT_DIM, triton.next_power_of_2(head_dim)),
        "BLOCK_SIZE": block_size,
        "BLOCK_Q": block_q,
        "KEY_TILE": DECODE_KEY_TILE if small_tile else PREFILL_KEY_TILE,
        "SINGLE_SPLIT": num_splits == 1,
        # float32 inputs multiply in full precision (not TF32) to match the reference; the
        # interpreter's tl.dot multiplies bf16 tensors' raw bits, so it gets float32 too.
        "FP32_DOT": dtype == torch.float32 or kernels_interpreted(),
    }
    return constants, DECODE_WARPS if small_tile else PREFILL_WARPS


def paged_attention_rows(
    out: torch.Tensor,
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    seqs: range,
    max_query_len: int,
    params: AttentionParams,
    num_splits: int = 1,
) -> None:
    """Attend the new tokens of sequences `seqs` into their rows of `out`.

    query/out: the whole batch's [tokens, heads, head_dim] (last dimension contiguous); kv_cache: one
    contiguous layer [2, kv_heads, blocks, block_size, head_dim]; query_start_loc (int32, on the
    device) gives each sequence's rows, seq_lens its context plus new tokens. Split-K is for the
    decodes (one token each), which come first.
    """
    num_heads, head_dim = query.shape[1], query.shape[2]
    if num_splits > 1 and (seqs.start != 0 or max_query_len != 1):
        raise ValueError("split-K is for the decodes: one token per sequence, from row 0")
    if not kv_cache.is_contiguous() or query.stride(-1) != 1 or out.stride(-1) != 1:
        raise ValueError("the Triton kernels need a contiguous cache and a contiguous last dimension")
    constants, num_warps = attention_constants(
        num_heads, kv_cache.shape[1], head_dim, kv_cache.shape[3], max_query_len, query.dtype, num_splits
    )
    head_dim_pad = constants["HEAD_DIM_PAD"]
    key_cache, value_cache = kv_cache[0], kv_cache[1]
    single = num_splits == 1
    # On a single split the kernel writes `out` directly and never touches the partials.
    partial_max = partial_sum = partial_out = out
    if not single:
        stats_shape = (len(seqs), num_heads, num_splits)
        partial_max = torch.empty(stats_shape, dtype=torch.float32, device=out.device)
        partial_sum = torch.empty_like(partial_max)
        partial_out = torch.empty(*stats_shape, head_dim_pad, dtype=torch.float32, device=out.device)
    grid = (len(seqs), triton.cdiv(max_query_len, constants["BLOCK_Q"]), kv_cache.shape[1] * num_splits)
    paged_attention_kernel[grid](
        query,
        key_cache,
        value_cache,
        block_table,
        seq_lens,
        query_start_loc,
        out,
        partial_out,
        partial_max,
        partial_sum,
        params.scale * LOG2E,
        params.window_or_zero,
        params.soft_cap_or_zero * LOG2E,
        seqs.start,
        num_splits,
        *query.stride()[:2],
        key_cache.stride(0),
        block_table.stride(0),
        *out.stride()[:2],
        **constants,
        SOFT_CAP=params.logits_soft_cap is not None,
        num_warps=num_warps,
    )
    if not single:
        merge_splits_kernel[(len(seqs), num_heads)](
            out,
            partial_out,
            partial_max,
            partial_sum,
            num_splits,
            *out.stride()[:2],
            HEAD_DIM=head_dim,
            HEAD_DIM_PAD=head_dim_pad,
            SPLITS_POW2=triton.next_power_of_2(num_splits),
        )
