"""A mixture-of-experts block's expert MLPs as a Triton grouped GEMM: the CUDA implementation of
`kernels.moe.fused_experts` (whose docstring gives the contract).

The (token, k) pairs are sorted by expert on the device and each expert's run padded to a whole
number of BLOCK_M rows, so that every block of rows belongs to one expert (vLLM's
moe_align_block_size, here in a few torch operators without a host synchronization: the grid is
sized for the most blocks the pairs can fill). One kernel, launched twice: the gated launch takes a
block of rows of the hidden states (through the pairs' tokens) times a block of the expert's gate
columns and the same block of its up columns, and stores silu(gate) * up; the second takes those
rows times the expert's down projection. A torch sum weights and adds each token's pairs.

Triton's kernels run on CUDA tensors, or on CPU tensors in Triton's interpreter when
TRITON_INTERPRET=1 was set before triton was imported (how the tests run this one without a GPU).
`kernels.moe` imports this module only for CUDA tensors, so that triton is needed nowhere else.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction


@triton.jit
def moe_gemm_kernel(
    a_ptr,
    w_ptr,
    out_ptr,
    pair_ids_ptr,
    block_experts_ptr,
    num_pairs,
    n,
    k,
    top_k,
    stride_a,
    stride_w_expert,
    stride_w_row,
    stride_out,
    GATED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    FP32_DOT: tl.constexpr,
):
    """out[pair, n-block] = a[row] @ w[expert][n-block].T for one block of an expert's pairs; gated:
    a's row is the pair's token, w stacks gate rows over n up rows, out = silu(gate) * up."""
    block = tl.program_id(0)
    expert = tl.load(block_experts_ptr + block)
    if expert < 0:  # past the last expert's blocks
        return
    pairs = tl.load(pair_ids_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = pairs < num_pairs  # a run's padding
    rows = pairs // top_k if GATED else pairs
    columns = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    column_ok = columns < n
    w_base = w_ptr + expert.to(tl.int64) * stride_w_expert
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for start in range(0, k, BLOCK_K):
        depth = start + tl.arange(0, BLOCK_K)
        depth_ok = depth < k
        a = tl.load(
            a_ptr + rows.to(tl.int64)[:, None] * stride_a + depth[None, :],
            mask=valid[:, None] & depth_ok[None, :],
            other=0.0,
        )
        w_mask = depth_ok[:, None] & column_ok[None, :]
        w = tl.load(w_base + columns[None, :] * stride_w_row + depth[:, None], mask=w_mask, other=0.0)
        acc += _dot(a, w, FP32_DOT)
        if GATED:
            up = tl.load(
                w_base + (columns + n)[None, :] * stride_w_row + depth[:, None], mask=w_mask, other=0.0
            )
            acc_up += _dot(a, up, FP32_DOT)
    dtype = out_ptr.dtype.element_ty
    if GATED:  # rounded where silu_and_mul of the rounded projections rounds
        gate = acc.to(dtype).to(tl.float32)
        silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
        result = (silu * acc_up.to(dtype).to(tl.float32)).to(dtype)
    else:
        result = acc.to(dtype)
    out = out_ptr + pairs.to(tl.int64)[:, None] * stride_out + columns[None, :]
    tl.store(out, result, mask=valid[:, None] & column_ok[None, :])


@triton.jit
def _dot(a, b, FP32_DOT: tl.constexpr):
    """a @ b in float32. FP32_DOT multiplies in float32 too (IEEE, no TF32): float32 models stay
    float32, and the interpreter's 16-bit dot is wrong; the products of 16-bit values are exact in
    float32, as on the tensor cores, so it changes how, not what, is computed."""
    if FP32_DOT:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b)


def align_pairs(local_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(pair ids [blocks * block_m], expert of each block [blocks]): the pairs of each expert in
    order, its run padded with `len(local_ids)` (no pair) to whole blocks; ids outside
    [0, num_experts) are left out, and blocks past the last run have expert -1. `blocks` is the most
    the pairs can fill, so that sizing the grid reads nothing back from the device."""
    num_pairs = local_ids.numel()
    device = local_ids.device
    held = (local_ids >= 0) & (local_ids < num_experts)
    bucket = torch.where(held, local_ids, num_experts)  # one bucket past the experts for the others
    counts = torch.zeros(num_experts + 1, dtype=torch.long, device=device)
    counts.scatter_add_(0, bucket, torch.ones_like(bucket))
    counts = counts[:num_experts]
    blocks = (counts + block_m - 1) // block_m
    block_ends = torch.cumsum(blocks, 0)
    max_blocks = triton.cdiv(num_pairs, block_m) + num_experts
    block_experts = torch.searchsorted(block_ends, torch.arange(max_blocks, device=device), right=True)
    block_experts = torch.where(block_experts < num_experts, block_experts, -1)
    order = torch.argsort(bucket, stable=True)
    sorted_bucket = bucket[order]
    expert = sorted_bucket.clamp(max=num_experts - 1)
    run_start = torch.cumsum(counts, 0) - counts
    position = (
        (block_ends - blocks)[expert] * block_m + torch.arange(num_pairs, device=device) - run_start[expert]
    )
    # The others' pairs all go to one slot past the blocks, which no program reads.
    trash = max_blocks * block_m
    position = torch.where(sorted_bucket < num_experts, position, trash)
    pair_ids = torch.full((trash + 1,), num_pairs, dtype=torch.long, device=device)
    pair_ids[position] = order
    return pair_ids[:trash], block_experts


def triton_fused_experts(
    hidden: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    first_expert: int = 0,
    block_m: int | None = None,
    block_n: int = 64,
    block_k: int = 64,
) -> torch.Tensor:
    """`kernels.moe.fused_experts` on CUDA tensors (CPU ones in the interpreter). Block sizes are
    powers of two of at least 16 (tl.dot's least); block_m by default 16 when the experts get few
    rows each (decoding), else 64."""
    num_tokens, top_k = topk_ids.shape
    num_experts, hidden_size = w13.shape[0], w13.shape[2]
    inter = w13.shape[1] // 2
    num_pairs = num_tokens * top_k
    if block_m is None:
        block_m = 16 if num_pairs <= 8 * num_experts else 64
    local = (topk_ids - first_expert).flatten()
    pair_ids, block_experts = align_pairs(local, num_experts, block_m)
    act = hidden.new_empty(num_pairs, inter)
    down = hidden.new_zeros(num_pairs, hidden_size)
    hidden, w13, w2 = hidden.contiguous(), w13.contiguous(), w2.contiguous()
    fp32_dot = hidden.dtype == torch.float32 or isinstance(moe_gemm_kernel, InterpretedFunction)
    constants = {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k, "FP32_DOT": fp32_dot}
    blocks = block_experts.numel()
    moe_gemm_kernel[(blocks, triton.cdiv(inter, block_n))](
        hidden, w13, act, pair_ids, block_experts, num_pairs, inter, hidden_size, top_k,
        hidden.stride(0), w13.stride(0), w13.stride(1), act.stride(0), GATED=True, **constants,
    )  # fmt: skip
    moe_gemm_kernel[(blocks, triton.cdiv(hidden_size, block_n))](
        act, w2, down, pair_ids, block_experts, num_pairs, hidden_size, inter, top_k,
        act.stride(0), w2.stride(0), w2.stride(1), down.stride(0), GATED=False, **constants,
    )  # fmt: skip
    held = (local >= 0) & (local < num_experts)
    weights = torch.where(held, topk_weights.flatten().float(), 0.0)
    combined = (down.float() * weights[:, None]).view(num_tokens, top_k, hidden_size).sum(dim=1)
    return combined.to(hidden.dtype)
