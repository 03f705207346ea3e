"""Reshape-and-cache as a Triton kernel: this step's keys and values into their cache slots.

The same job as `kernels.cache_ops.reshape_and_cache` (the layout is documented there), in one launch
with one program per token, which writes all of its KV heads. A negative slot means "no slot" (a
padding row, as in vLLM) and is skipped.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def reshape_and_cache_kernel(
    key_ptr,
    value_ptr,
    key_cache_ptr,
    value_cache_ptr,
    slot_mapping_ptr,
    stride_k_token,
    stride_k_head,
    stride_v_token,
    stride_v_head,
    stride_c_head,
    stride_c_block,
    stride_c_token,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEADS_POW2: tl.constexpr,
    HEAD_DIM_POW2: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token)
    heads = tl.arange(0, HEADS_POW2)
    dims = tl.arange(0, HEAD_DIM_POW2)
    # A padding slot writes no head. (The interpreter cannot mask with a scalar condition.)
    heads_to_write = tl.where(slot >= 0, NUM_KV_HEADS, 0)
    mask = (heads < heads_to_write)[:, None] & (dims < HEAD_DIM)[None, :]
    cache_offsets = (
        heads[:, None] * stride_c_head
        + (slot // BLOCK_SIZE) * stride_c_block
        + (slot % BLOCK_SIZE) * stride_c_token
        + dims[None, :]
    )
    key = tl.load(
        key_ptr + token * stride_k_token + heads[:, None] * stride_k_head + dims[None, :], mask=mask
    )
    value = tl.load(
        value_ptr + token * stride_v_token + heads[:, None] * stride_v_head + dims[None, :], mask=mask
    )
    tl.store(key_cache_ptr + cache_offsets, key.to(key_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(value_cache_ptr + cache_offsets, value.to(value_cache_ptr.dtype.element_ty), mask=mask)


def triton_reshape_and_cache(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store key/value ([tokens, kv_heads, head_dim], last dimension contiguous) at their slots."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    if key.stride(-1) != 1 or value.stride(-1) != 1:
        raise ValueError("triton_reshape_and_cache needs key and value contiguous in their last dimension")
    key_cache, value_cache = kv_cache[0], kv_cache[1]
    reshape_and_cache_kernel[(num_tokens,)](
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        *key.stride()[:2],
        *value.stride()[:2],
        *key_cache.stride()[:3],
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        HEADS_POW2=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM_POW2=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=kv_cache.shape[3],
    )
