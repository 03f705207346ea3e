"""Writes into and moves between KV cache blocks.

A layer's cache is one tensor of shape [2, num_kv_heads, num_blocks, block_size, head_dim] (keys,
then values). Heads come before blocks so that gathering a sequence's blocks with one
`index_select` leaves each head's keys contiguous in token order, ready for a matmul without a
transposing copy. Token slot s lives at block s // block_size, offset s % block_size.

An int8 cache (`kv_cache_dtype="int8"`) keeps that one tensor per layer, as int8 of shape
[2, num_kv_heads, num_blocks, block_size, head_dim + 4]: each (token, KV head) row holds head_dim
int8 values, then the row's float32 scale in its last 4 bytes (kernels/csrc/int8_kv.h). A row is
quantized symmetrically as it is written: scale = max |x| / 127, value = round(x / scale), ties to
even. Blocks stay slices along the same dimension, so copies, swaps and shared prefixes move them as
they are; only the C++ ops read or write such a cache (`reshape_and_cache` here, and the `int8`
path of kernels/attention/cpu_paged.py), the torch paths refuse it.
"""

from __future__ import annotations

import torch

from kernels.build import cpu_kernels_available

BLOCK_DIM = 2  # the dimension of a layer's cache that indexes blocks
INT8_SCALE_BYTES = 4  # the float32 scale at the end of each row of an int8 cache


def cache_row_width(head_dim: int, dtype: torch.dtype) -> int:
    """Elements of one (token, KV head) row of a cache of `dtype`: head_dim, and an int8 row's scale."""
    return head_dim + INT8_SCALE_BYTES if dtype == torch.int8 else head_dim


def _refuse_int8(kv_cache: torch.Tensor, what: str) -> None:
    if kv_cache.dtype == torch.int8:
        raise ValueError(
            f"{what} cannot read or write an int8 KV cache (kv_cache_dtype='int8'): only the C++ CPU "
            "kernels of the cpu_paged attention backend do"
        )


def reshape_and_cache(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store this step's keys and values ([tokens, kv_heads, head_dim]) at their slots.

    On the CPU one C++ call (kernels/csrc/cache_ops.cpp) copies every row, in less time than the two
    `index_copy_` calls it replaced (docs/performance.md); it refuses a slot outside the cache with
    the slot named. Into an int8 cache the C++ op quantizes each row as it stores it.
    """
    if kv_cache.dtype == torch.int8:
        if not cpu_kernels_available():
            raise RuntimeError(
                "an int8 KV cache (kv_cache_dtype='int8') needs the C++ CPU kernels, not built here"
            )
        torch.ops.raypage.reshape_and_cache_int8(key, value, kv_cache, slot_mapping.long())
        return
    if kv_cache.is_cpu and key.is_cpu and cpu_kernels_available():
        key, value = key.to(kv_cache.dtype), value.to(kv_cache.dtype)
        if key.stride(-1) == 1 and value.stride(-1) == 1 and kv_cache.is_contiguous():
            torch.ops.raypage.reshape_and_cache(key, value, kv_cache, slot_mapping.long())
            return
    reshape_and_cache_torch(key, value, kv_cache, slot_mapping)


def reshape_and_cache_torch(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """reshape_and_cache in torch operators: any device, and the reference attention's own path."""
    _refuse_int8(kv_cache, "reshape_and_cache_torch")
    num_kv_heads, head_dim = kv_cache.shape[1], kv_cache.shape[-1]
    slots = kv_cache.view(2, num_kv_heads, -1, head_dim)
    slots[0].index_copy_(1, slot_mapping, key.transpose(0, 1).to(kv_cache.dtype))
    slots[1].index_copy_(1, slot_mapping, value.transpose(0, 1).to(kv_cache.dtype))


def gather_blocks(kv_cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """Keys and values of the given blocks, in order: [2, kv_heads, len(block_ids) * block_size, head_dim]."""
    _refuse_int8(kv_cache, "gather_blocks")
    num_kv_heads, head_dim = kv_cache.shape[1], kv_cache.shape[-1]
    return kv_cache.index_select(BLOCK_DIM, block_ids.flatten()).view(2, num_kv_heads, -1, head_dim)


def copy_blocks(kv_caches: list[torch.Tensor], src_to_dst: torch.Tensor) -> None:
    """Copy whole blocks within each layer's cache; `src_to_dst` is [pairs, 2] block ids."""
    if src_to_dst.numel() == 0:
        return
    src, dst = src_to_dst[:, 0], src_to_dst[:, 1]
    for kv_cache in kv_caches:
        kv_cache.index_copy_(BLOCK_DIM, dst, kv_cache.index_select(BLOCK_DIM, src))


def swap_blocks(src: torch.Tensor, dst: torch.Tensor, src_to_dst: torch.Tensor) -> None:
    """Copy blocks of one layer between caches on different devices (CPU swap space <-> device)."""
    if src_to_dst.numel() == 0:
        return
    src_ids = src_to_dst[:, 0].to(src.device)
    dst_ids = src_to_dst[:, 1].to(dst.device)
    dst.index_copy_(BLOCK_DIM, dst_ids, src.index_select(BLOCK_DIM, src_ids).to(dst.device))
