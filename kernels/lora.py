"""The products LoRA adapters add to a projection, for a batch whose rows run different adapters.

A projection y = x W^T with adapter s adds (x A_s^T) B_s^T to the rows that run s: a "shrink" to
the adapter's rank, then an "expand" back to the output features (the adapter's scaling is folded
into B at load). A step's batch mixes rows of the base model and of several adapters, so the rows
are grouped by adapter slot once per step (`LoRABatch`), and every projection then computes all its
adapters' products in one call, each adapter's rows together: never one forward pass per adapter.

A fused projection (Q, K and V; gate and up) has one A and one B per part. They are stacked: its
A holds `num_slices * rank` rows (part j's shrink in columns [j * rank, (j + 1) * rank)), and output
features of part j read only those columns. Adapters of a lower rank than the slots' are padded
with zeros, and an adapter without one of the parts has zeros there; zeros add exactly nothing.

Three implementations, one contract: the C++ kernel on the CPU (kernels/csrc/lora.cpp: both
products for all slots in one call, on AMX tiles where the CPU has them), two Triton kernels on CUDA
(kernels/triton_lora.py), and `add_lora_reference`, a per-slot loop in torch that runs where neither
does. The kernels keep the shrink in float32 and round once, adding to out; the reference rounds the
shrink, the expand and the sum to the dtype in turn.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kernels.build import cpu_kernels_available

_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class LoRABatch:
    """One step's rows grouped by adapter slot: slot s's rows are
    `token_order[slot_starts[s]:slot_starts[s + 1]]`; rows without an adapter are left out."""

    token_order: torch.Tensor  # int64 [rows with an adapter]
    slot_starts: torch.Tensor  # int64 [num_slots + 1], on the device
    slot_starts_list: tuple[int, ...]  # the same on the host, so that no step waits on the device

    @classmethod
    def from_token_slots(cls, token_slots: np.ndarray, num_slots: int, device: torch.device) -> LoRABatch:
        """The grouping of rows whose slots are `token_slots` (-1: the base model's row)."""
        with_adapter = np.flatnonzero(token_slots >= 0)
        order = with_adapter[np.argsort(token_slots[with_adapter], kind="stable")]
        counts = np.bincount(token_slots[with_adapter], minlength=num_slots)
        starts = np.concatenate(([0], np.cumsum(counts))).astype(np.int64)
        return cls(
            torch.from_numpy(order.astype(np.int64)).to(device),
            torch.from_numpy(starts).to(device),
            tuple(int(start) for start in starts),
        )

    @property
    def active_slots(self) -> list[int]:
        starts = self.slot_starts_list
        return [slot for slot in range(len(starts) - 1) if starts[slot + 1] > starts[slot]]


def add_lora(
    out: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    slice_sizes: Sequence[int],
    batch: LoRABatch,
) -> None:
    """out[rows of s] += (x[rows of s] A_s^T) B_s^T for every slot s, in place.

    out: [T, out_features]; x: [T, in_features]; lora_a: [slots, len(slice_sizes) * rank,
    in_features]; lora_b: [slots, out_features, rank]; `slice_sizes` (summing to out_features) are
    the output features of each part of a fused projection. All four of one dtype; each row of
    out appears at most once in `batch`.
    """
    if out.is_cuda:
        from kernels.triton_lora import MAX_PARTS, triton_add_lora  # imports triton: CUDA only

        if out.dtype in _KERNEL_DTYPES and len(slice_sizes) <= MAX_PARTS:
            triton_add_lora(out, x, lora_a, lora_b, slice_sizes, batch)
            return
    elif out.is_cpu and out.dtype in _KERNEL_DTYPES and cpu_kernels_available():
        # One call for all slots; it checks the shapes and dtypes, and takes any layout. (These
        # few tests are all this path pays in Python: a decode step makes a hundred calls.)
        torch.ops.raypage.add_lora(out, x, lora_a, lora_b, slice_sizes, batch.token_order, batch.slot_starts)
        return
    add_lora_reference(out, x, lora_a, lora_b, slice_sizes, batch)


def add_lora_reference(
    out: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    slice_sizes: Sequence[int],
    batch: LoRABatch,
) -> None:
    """`add_lora` in torch operations: one shrink and an expand per part for each slot's rows."""
    rank = lora_b.shape[-1]
    starts = batch.slot_starts_list
    for slot in batch.active_slots:
        rows = batch.token_order[starts[slot] : starts[slot + 1]]
        shrunk = x.index_select(0, rows) @ lora_a[slot].t()
        offset = 0
        delta = torch.empty(len(rows), out.shape[1], dtype=out.dtype, device=out.device)
        for part, size in enumerate(slice_sizes):
            columns = shrunk[:, part * rank : (part + 1) * rank]
            delta[:, offset : offset + size] = columns @ lora_b[slot, offset : offset + size].t()
            offset += size
        out.index_add_(0, rows, delta)
