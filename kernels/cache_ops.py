"""Writes into and moves between KV cache blocks.

A layer's cache is one tensor of shape [2, num_blocks, block_size, num_kv_heads, head_dim] (keys,
then values); token slot s lives at block s // block_size, offset s % block_size.
"""

from __future__ import annotations

import torch


def reshape_and_cache(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store this step's keys and values ([tokens, kv_heads, head_dim]) at their slots."""
    num_kv_heads, head_dim = kv_cache.shape[-2:]
    flat = kv_cache.view(2, -1, num_kv_heads, head_dim)
    flat[0].index_copy_(0, slot_mapping, key.to(kv_cache.dtype))
    flat[1].index_copy_(0, slot_mapping, value.to(kv_cache.dtype))


def copy_blocks(kv_caches: list[torch.Tensor], src_to_dst: torch.Tensor) -> None:
    """Copy whole blocks within each layer's cache; `src_to_dst` is [pairs, 2] block ids."""
    if src_to_dst.numel() == 0:
        return
    src, dst = src_to_dst[:, 0], src_to_dst[:, 1]
    for kv_cache in kv_caches:
        kv_cache[:, dst] = kv_cache[:, src]


def swap_blocks(src: torch.Tensor, dst: torch.Tensor, src_to_dst: torch.Tensor) -> None:
    """Copy blocks of one layer between caches on different devices (CPU swap space <-> device)."""
    if src_to_dst.numel() == 0:
        return
    src_ids = src_to_dst[:, 0].to(src.device)
    dst_ids = src_to_dst[:, 1].to(dst.device)
    dst[:, dst_ids] = src[:, src_ids].to(dst.device)
