"""The KV cache tensors of one worker: one [2, kv_heads, blocks, block_size, head_dim] tensor per layer
(the layout kernels/cache_ops.py documents; int8 rows carry their scale too), and a host pool of the
same layout for swapped blocks."""

from __future__ import annotations

from typing import Literal

import torch

from engine.outputs import SchedulerOutput
from kernels.attention import AttentionBackend
from kernels.attention.cpu_paged import cpu_paged_attention
from kernels.cache_ops import cache_row_width, copy_blocks, swap_blocks
from kernels.huge_pages import prefault_in_background, zeros_on_huge_pages


def resolve_kv_cache_dtype(
    setting: Literal["auto", "int8"],
    model_dtype: torch.dtype,
    attention_backend: AttentionBackend,
    device: torch.device,
) -> torch.dtype:
    """The caches' element type for `kv_cache_dtype`: the model's for "auto"; int8 only where the
    cpu_paged backend attends with its C++ kernels, the one backend with a path that reads int8 rows.

    Checked on the worker, where the backend is picked: the device, attention_backend,
    $RAYPAGE_ATTENTION_BACKEND and a failed kernel build (which leaves the sdpa backend) all end there.
    """
    if setting == "auto":
        return model_dtype
    if attention_backend is not cpu_paged_attention:
        raise ValueError(
            f"kv_cache_dtype='int8' needs the cpu_paged attention backend on the CPU with its C++ kernels; "
            f"on {device.type} attention runs in {attention_backend.__name__} here (see attention_backend, "
            "and the log for a kernel build that failed); use kv_cache_dtype='auto'"
        )
    return torch.int8


class CacheEngine:
    """Allocates this worker's share of the paged KV cache (its layers, its KV heads) and moves blocks."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        layer_specs: dict[int, tuple[int, int]],
        dtype: torch.dtype,
        device: torch.device,
        num_cpu_blocks: int = 0,
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        # Each layer's KV heads and the elements of one of their rows (an int8 row holds its scale too).
        rows = {
            layer: (kv_heads, cache_row_width(head_dim, dtype))
            for layer, (kv_heads, head_dim) in layer_specs.items()
        }
        # Zeroed, not empty: padded reads of never-written slots must not meet NaN garbage. On huge
        # pages where the host allows: decode attention reads blocks scattered across the whole cache.
        self.kv_caches = {
            layer: zeros_on_huge_pages(2, kv_heads, num_blocks, block_size, width, dtype=dtype, device=device)
            for layer, (kv_heads, width) in rows.items()
        }
        # Empty is safe here: a host block is always written by a swap-out before a swap-in reads it.
        pin = device.type == "cuda"
        self.cpu_caches = {
            layer: torch.empty(2, kv_heads, num_cpu_blocks, block_size, width, dtype=dtype, pin_memory=pin)
            for layer, (kv_heads, width) in rows.items()
            if num_cpu_blocks
        }
        # The engine answers while the pages fault in between its steps (seconds per GiB). Started after the
        # host pool's allocation: faulting in holds the process's memory map, and each mapping of a
        # new tensor would wait for it.
        prefault_in_background(list(self.kv_caches.values()))

    def move_blocks(self, scheduler_output: SchedulerOutput) -> None:
        """The step's block moves, before its forward pass: swaps out, swaps in, then copies."""
        for moves, to_host in (
            (scheduler_output.blocks_to_swap_out, True),
            (scheduler_output.blocks_to_swap_in, False),
        ):
            if not moves:
                continue
            pairs = torch.tensor(moves, dtype=torch.int64)
            for layer, device_cache in self.kv_caches.items():
                host_cache = self.cpu_caches[layer]
                if to_host:
                    swap_blocks(device_cache, host_cache, pairs)
                else:
                    swap_blocks(host_cache, device_cache, pairs)
        if scheduler_output.blocks_to_copy:
            device = next(iter(self.kv_caches.values())).device
            copy_blocks(
                list(self.kv_caches.values()), torch.tensor(scheduler_output.blocks_to_copy, device=device)
            )

    @staticmethod
    def bytes_per_block(block_size: int, layer_specs: dict[int, tuple[int, int]], dtype: torch.dtype) -> int:
        """Bytes of one block across the layers' caches of `dtype` (an int8 row's scale included)."""
        element = torch.tensor([], dtype=dtype).element_size()
        return sum(
            2 * block_size * kv_heads * cache_row_width(head_dim, dtype) * element
            for kv_heads, head_dim in layer_specs.values()
        )
