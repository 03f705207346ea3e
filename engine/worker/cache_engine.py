"""The KV cache tensors of one worker: one [2, kv_heads, blocks, block_size, head_dim] tensor per layer
(the layout kernels/cache_ops.py documents)."""

from __future__ import annotations

import torch


class CacheEngine:
    """Allocates this worker's share of the paged KV cache (its layers, its KV heads)."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        layer_specs: dict[int, tuple[int, int]],
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        # Zeroed, not empty: padded reads of never-written slots must not meet NaN garbage.
        self.kv_caches = {
            layer: torch.zeros(2, kv_heads, num_blocks, block_size, head_dim, dtype=dtype, device=device)
            for layer, (kv_heads, head_dim) in layer_specs.items()
        }

    @staticmethod
    def bytes_per_block(block_size: int, layer_specs: dict[int, tuple[int, int]], dtype: torch.dtype) -> int:
        element = torch.tensor([], dtype=dtype).element_size()
        return sum(
            2 * block_size * kv_heads * head_dim * element for kv_heads, head_dim in layer_specs.values()
        )
