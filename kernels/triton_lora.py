"""LoRA adapters' products as two Triton kernels segmented by adapter slot: the CUDA implementation
of `kernels.lora.add_lora` (whose docstring gives the contract).

The rows are already grouped by slot (`LoRABatch`: token_order, slot_starts), so a program takes a
block of one slot's rows through token_order, with no sorting on the device; the grid is sized from
the host's copy of slot_starts (the most rows any slot has), and programs past their slot's rows
return at once. Two launches a projection:

- the shrink: a block of rows times a block of A_s's rows, float32 sums stored in float32 (a row per
  entry of token_order, len(slice_sizes) * rank values), never rounded;
- the expand: those float32 rows times a block of output columns of B_s, added to out's values and
  rounded once. Columns of different parts of a fused projection read different shrink columns;
  the kernel multiplies along all len(slice_sizes) * rank of them, with B's values for the columns
  of other parts masked to zero, so that one tile serves columns of any parts.

Triton's kernels run on CUDA tensors, or on CPU tensors in Triton's interpreter when
TRITON_INTERPRET=1 was set before triton was imported (how the tests run these without a GPU).
`kernels.lora` imports this module only for CUDA tensors, so that triton is needed nowhere else.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

if TYPE_CHECKING:
    from kernels.lora import LoRABatch

# The kernel takes the parts' first columns as scalars: the most parts a fused projection has here.
MAX_PARTS = 4
# tl.dot needs every dimension of a tile to be at least 16 on the GPU.
MIN_DOT_DIM = 16


@triton.jit
def lora_shrink_kernel(
    x_ptr,
    a_ptr,
    shrunk_ptr,
    token_order_ptr,
    slot_starts_ptr,
    n,
    k,
    stride_x,
    stride_a_slot,
    stride_a_row,
    stride_shrunk,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    FP32_DOT: tl.constexpr,
):
    """shrunk[i, n-block] = x[token_order[i]] @ A_s[n-block].T in float32, for a block of slot s's
    entries i of token_order (s = program 0, the block = program 1, the columns = program 2)."""
    slot = tl.program_id(0)
    start = tl.load(slot_starts_ptr + slot)
    end = tl.load(slot_starts_ptr + slot + 1)
    first = start + tl.program_id(1) * BLOCK_M
    if first >= end:  # past this slot's rows
        return
    positions = first + tl.arange(0, BLOCK_M)
    valid = positions < end
    rows = tl.load(token_order_ptr + positions, mask=valid, other=0).to(tl.int64)
    columns = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    column_ok = columns < n
    a_base = a_ptr + slot.to(tl.int64) * stride_a_slot
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for start_k in range(0, k, BLOCK_K):
        depth = start_k + tl.arange(0, BLOCK_K)
        depth_ok = depth < k
        x = tl.load(
            x_ptr + rows[:, None] * stride_x + depth[None, :],
            mask=valid[:, None] & depth_ok[None, :],
            other=0.0,
        )
        a = tl.load(
            a_base + columns[None, :] * stride_a_row + depth[:, None],
            mask=depth_ok[:, None] & column_ok[None, :],
            other=0.0,
        )
        if FP32_DOT:
            acc += tl.dot(x.to(tl.float32), a.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(x, a)
    out = shrunk_ptr + positions.to(tl.int64)[:, None] * stride_shrunk + columns[None, :]
    tl.store(out, acc, mask=valid[:, None] & column_ok[None, :])


@triton.jit
def lora_expand_kernel(
    shrunk_ptr,
    b_ptr,
    out_ptr,
    token_order_ptr,
    slot_starts_ptr,
    n,
    rank,
    part1,
    part2,
    part3,
    stride_shrunk,
    stride_b_slot,
    stride_b_row,
    stride_out,
    NUM_PARTS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """out[token_order[i], n-block] += shrunk[i, part's columns] @ B_s[n-block].T, summed in
    float32 and rounded once, for a block of slot s's entries i of token_order. part1..part3 are
    the first output columns of parts 1-3 (those past NUM_PARTS unused)."""
    slot = tl.program_id(0)
    start = tl.load(slot_starts_ptr + slot)
    end = tl.load(slot_starts_ptr + slot + 1)
    first = start + tl.program_id(1) * BLOCK_M
    if first >= end:
        return
    positions = first + tl.arange(0, BLOCK_M)
    valid = positions < end
    rows = tl.load(token_order_ptr + positions, mask=valid, other=0).to(tl.int64)
    columns = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    column_ok = columns < n
    part = tl.zeros((BLOCK_N,), dtype=tl.int32)
    if NUM_PARTS > 1:
        part += (columns >= part1).to(tl.int32)
    if NUM_PARTS > 2:
        part += (columns >= part2).to(tl.int32)
    if NUM_PARTS > 3:
        part += (columns >= part3).to(tl.int32)
    depth = tl.arange(0, BLOCK_K)  # a shrink column: part depth // rank, rank index depth % rank
    depth_ok = depth < NUM_PARTS * rank
    s = tl.load(
        shrunk_ptr + positions.to(tl.int64)[:, None] * stride_shrunk + depth[None, :],
        mask=valid[:, None] & depth_ok[None, :],
        other=0.0,
    )
    # B_s's value for (shrink column, output column): its rank index where the shrink column is of
    # the output column's part, else zero.
    q = depth[:, None] - part[None, :] * rank
    b_mask = depth_ok[:, None] & column_ok[None, :] & (q >= 0) & (q < rank)
    b_base = b_ptr + slot.to(tl.int64) * stride_b_slot
    b = tl.load(b_base + columns[None, :] * stride_b_row + q, mask=b_mask, other=0.0)
    acc = tl.dot(s, b.to(tl.float32), input_precision="ieee")
    out = out_ptr + rows[:, None] * stride_out + columns[None, :]
    out_mask = valid[:, None] & column_ok[None, :]
    current = tl.load(out, mask=out_mask, other=0.0)
    tl.store(out, (current.to(tl.float32) + acc).to(out_ptr.dtype.element_ty), mask=out_mask)


def triton_add_lora(
    out: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    slice_sizes: Sequence[int],
    batch: LoRABatch,
    block_m: int | None = None,
    block_n: int = 64,
    block_k: int = 64,
) -> None:
    """`kernels.lora.add_lora` on CUDA tensors (CPU ones in the interpreter), at most MAX_PARTS
    parts. Block sizes are powers of two of at least 16 (tl.dot's least); block_m by default 16
    when the slots have few rows each (decoding), else 64."""
    if len(slice_sizes) > MAX_PARTS:
        raise ValueError(f"triton_add_lora handles at most {MAX_PARTS} parts, got {len(slice_sizes)}")
    starts = batch.slot_starts_list
    most_rows = max((end - begin for begin, end in itertools.pairwise(starts)), default=0)
    if most_rows == 0:
        return
    if out.stride(1) != 1:
        raise ValueError("triton_add_lora needs out contiguous in its last dimension")
    num_slots = len(starts) - 1
    rank = lora_b.shape[2]
    shrink_width = len(slice_sizes) * rank
    if block_m is None:
        block_m = 16 if most_rows <= 16 else 64
    x, lora_a, lora_b = x.contiguous(), lora_a.contiguous(), lora_b.contiguous()
    shrunk = torch.empty(batch.token_order.numel(), shrink_width, dtype=torch.float32, device=out.device)
    fp32_dot = x.dtype == torch.float32 or isinstance(lora_shrink_kernel, InterpretedFunction)
    row_blocks = triton.cdiv(most_rows, block_m)
    shrink_n = max(MIN_DOT_DIM, min(block_n, triton.next_power_of_2(shrink_width)))
    lora_shrink_kernel[(num_slots, row_blocks, triton.cdiv(shrink_width, shrink_n))](
        x, lora_a, shrunk, batch.token_order, batch.slot_starts, shrink_width, x.shape[1],
        x.stride(0), lora_a.stride(0), lora_a.stride(1), shrunk.stride(0),
        BLOCK_M=block_m, BLOCK_N=shrink_n, BLOCK_K=block_k, FP32_DOT=fp32_dot,
    )  # fmt: skip
    part_starts = [sum(slice_sizes[:j]) for j in range(1, MAX_PARTS)]
    lora_expand_kernel[(num_slots, row_blocks, triton.cdiv(out.shape[1], block_n))](
        shrunk, lora_b, out, batch.token_order, batch.slot_starts, out.shape[1], rank, *part_starts,
        shrunk.stride(0), lora_b.stride(0), lora_b.stride(1), out.stride(0),
        NUM_PARTS=len(slice_sizes), BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_K=max(MIN_DOT_DIM, triton.next_power_of_2(shrink_width)),
    )  # fmt: skip
