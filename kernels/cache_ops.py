"""Writes into and moves between KV cache blocks.

A layer's cache is one tensor of shape [2, num_kv_heads, num_blocks, block_size, head_dim] (keys,
then values). Heads come before blocks so that gathering a sequence's blocks with one
`index_select` leaves each head's keys contiguous in token order, ready for a matmul without a
transposing copy. Token slot s lives at block s // block_size, offset s % block_size.
"""

from __future__ import annotations

import torch

from kernels.build import cpu_kernels_available

BLOCK_DIM = 2  # the dimension of a layer's cache that indexes blocks


def reshape_and_cache(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store this step's keys and values ([tokens, kv_heads, head_dim]) at their slots.

    On the CPU one C++ call (kernels/csrc/cache_ops.cpp) copies every row, in less time than the two
    `index_copy_` calls it replaced (docs/performance.md); it refuses a slot outside the cache with
    the slot named.
    """
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
    num_kv_heads, head_dim = kv_cache.shape[1], kv_cache.shape[-1]
    slots = kv_cache.view(2, num_kv_heads, -1, head_dim)
    slots[0].index_copy_(1, slot_mapping, key.transpose(0, 1).to(kv_cache.dtype))
    slots[1].index_copy_(1, slot_mapping, value.transpose(0, 1).to(kv_cache.dtype))


def gather_blocks(kv_cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """Keys and values of the given blocks, in order: [2, kv_heads, len(block_ids) * block_size, head_dim]."""
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
