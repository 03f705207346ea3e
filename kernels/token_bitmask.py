"""Structured outputs' last step before sampling: a grammar's token bitmask applied to the logits, in
place, so that every token the grammar disallows gets -inf.

The grammar engine (llguidance, xgrammar) fills one mask row per constrained sequence: int32 words,
`ceil(vocab / 32)` of them, bit `t % 32` (least significant first) of word `t // 32` set where token t
is allowed (`llguidance.numpy.allocate_token_bitmask`'s layout). A logits row may be wider than its
mask (a model's vocabulary padded beyond its tokenizer's): tokens past the mask are never allowed.

Three implementations, chosen in `apply_token_bitmask_`: the Triton kernel (kernels/triton_bitmask.py)
for CUDA logits, imported only there; the C++ op (kernels/csrc/token_bitmask.cpp) for CPU logits in
the dtypes it takes; and plain torch, which serves everywhere else (no triton, no compiled kernels,
another float dtype or layout). All three give bit-identical results.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import torch
from torch import Tensor

from kernels.build import cpu_kernels_available

logger = logging.getLogger(__name__)

_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def apply_token_bitmask_(logits: Tensor, bitmask: Tensor, rows: Tensor | None = None) -> Tensor:
    """In place: logits[rows[i], t] = -inf for every token t whose bit in bitmask[i] is 0, and for every
    t >= 32 * bitmask.shape[1] (tokens past the mask's width: the model's vocabulary may be padded
    beyond the tokenizer's). Mask bits beyond logits.shape[1] are ignored. rows=None means row i of
    the mask is row i of logits. Returns logits.

    logits: [num_rows, vocab], floating point (the kernels take float32, bf16 and fp16 with
    contiguous rows; anything else goes through plain torch). bitmask: int32 [n, words]. rows: [n]
    distinct integer indices into logits, or None (then n == num_rows). A bitmask or rows on another
    device than logits are copied there first. On CUDA, rows outside logits are skipped (checking them
    would wait for the device); elsewhere they raise.
    """
    _check(logits, bitmask, rows)
    # Host to device without waiting (the copy is ordered before the kernel on the stream); never the
    # other way, where the host could read the copy before it lands.
    non_blocking = logits.is_cuda
    bitmask = bitmask.to(logits.device, non_blocking=non_blocking)
    if rows is not None:
        rows = rows.to(logits.device, torch.int64, non_blocking=non_blocking)
    if bitmask.shape[0] == 0 or logits.shape[1] == 0:
        return logits
    if logits.dtype not in _KERNEL_DTYPES or logits.stride(1) != 1:
        return apply_token_bitmask_torch(logits, bitmask, rows)
    # The kernels take any row stride of the mask, but its words and the rows one after the other.
    if bitmask.stride(1) != 1:
        bitmask = bitmask.contiguous()
    if rows is not None:
        rows = rows.contiguous()
    if logits.is_cuda and (triton_kernel := _triton_kernel()) is not None:
        triton_kernel(logits, bitmask, rows)
    elif logits.is_cpu and cpu_kernels_available():
        torch.ops.raypage.apply_token_bitmask(logits, bitmask, rows)
    else:
        apply_token_bitmask_torch(logits, bitmask, rows)
    return logits


def _check(logits: Tensor, bitmask: Tensor, rows: Tensor | None) -> None:
    """ValueError for shapes and dtypes that no implementation takes, before any of them runs."""
    if logits.dim() != 2 or not logits.is_floating_point():
        raise ValueError(
            f"logits must be a floating-point [rows, vocab] tensor, not {logits.dtype} {tuple(logits.shape)}"
        )
    if bitmask.dim() != 2 or bitmask.dtype != torch.int32:
        raise ValueError(f"bitmask must be int32 [n, words], not {bitmask.dtype} {tuple(bitmask.shape)}")
    if rows is None:
        if bitmask.shape[0] != logits.shape[0]:
            raise ValueError(
                f"without rows the bitmask needs one row per logits row: {bitmask.shape[0]} for {logits.shape[0]}"
            )
    elif (
        rows.dim() != 1 or rows.shape[0] != bitmask.shape[0] or rows.is_floating_point() or rows.is_complex()
    ):
        raise ValueError(
            f"rows must be [n] integer indices, one per mask row, not {rows.dtype} {tuple(rows.shape)}"
        )


def apply_token_bitmask_torch(logits: Tensor, bitmask: Tensor, rows: Tensor | None = None) -> Tensor:
    """apply_token_bitmask_ in plain torch (no check of its arguments; all on one device, rows int64):
    each word's 32 bits unpacked by shifts into a boolean [n, 32 * words] (only the words that cover
    the vocabulary), then one masked_fill per part of the row."""
    n, vocab = bitmask.shape[0], logits.shape[1]
    words = min(bitmask.shape[1], -(-vocab // 32))
    covered = min(vocab, 32 * words)
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    # An arithmetic shift (int32 is signed) then & 1: bit 31, the sign, comes out as 0 or 1 too.
    disallowed = (((bitmask[:, :words, None] >> shifts) & 1) == 0).reshape(n, 32 * words)[:, :covered]
    # Advanced indexing copies: the selected rows are masked in that copy, then copied back.
    target = logits if rows is None else logits.index_select(0, rows)
    target[:, :covered].masked_fill_(disallowed, float("-inf"))
    target[:, covered:] = float("-inf")
    if rows is not None:
        logits.index_copy_(0, rows, target)
    return logits


@functools.cache
def _triton_kernel() -> Callable[[Tensor, Tensor, Tensor | None], None] | None:
    """The Triton implementation, imported on first use; None (logged once) where triton is missing."""
    try:
        from kernels.triton_bitmask import triton_apply_token_bitmask_
    except ImportError as exc:
        logger.warning("triton unavailable, token bitmasks on CUDA use plain torch: %s", exc)
        return None
    return triton_apply_token_bitmask_
