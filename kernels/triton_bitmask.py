"""A grammar's token bitmask applied to logits in place, as a Triton kernel: the CUDA implementation
of `kernels.token_bitmask.apply_token_bitmask_` (whose docstring gives the mask's layout).

One program per (mask row, block of WORDS_PER_BLOCK mask words, 32 tokens each). It reads only the
mask and stores -inf where a bit is clear, a masked store: the logits themselves are never read.
Triton's kernels run on CUDA tensors, or on CPU tensors in Triton's interpreter when
TRITON_INTERPRET=1 was set before triton was imported (how the tests run this one without a GPU).
`kernels.token_bitmask` imports this module only for CUDA logits, so that triton is needed nowhere else.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

# 32 words are 1024 tokens a program: a [32, 32] tile, a few elements per thread of 4 warps.
WORDS_PER_BLOCK = 32


@triton.jit
def apply_token_bitmask_kernel(
    logits_ptr,
    bitmask_ptr,
    rows_ptr,
    num_rows,
    vocab,
    words,
    stride_logits,
    stride_mask,
    HAS_ROWS: tl.constexpr,
    WORDS_PER_BLOCK: tl.constexpr,
):
    mask_row = tl.program_id(0).to(tl.int64)
    row = tl.load(rows_ptr + mask_row) if HAS_ROWS else mask_row
    word_ids = tl.program_id(1) * WORDS_PER_BLOCK + tl.arange(0, WORDS_PER_BLOCK)
    # Words past the mask's width read as 0: their tokens are disallowed.
    mask_words = tl.load(bitmask_ptr + mask_row * stride_mask + word_ids, mask=word_ids < words, other=0)
    bits = tl.arange(0, 32)
    disallowed = ((mask_words[:, None] >> bits[None, :]) & 1) == 0
    tokens = word_ids[:, None] * 32 + bits[None, :]
    # A row outside logits writes nothing rather than outside the tensor: checking it on the host would
    # wait for the device. (The interpreter cannot mask with a scalar condition, hence the limit.)
    limit = tl.where((row >= 0) & (row < num_rows), vocab, 0)
    neg_inf = tl.full([WORDS_PER_BLOCK, 32], float("-inf"), logits_ptr.dtype.element_ty)
    tl.store(logits_ptr + row * stride_logits + tokens, neg_inf, mask=disallowed & (tokens < limit))


def triton_apply_token_bitmask_(
    logits: torch.Tensor,
    bitmask: torch.Tensor,
    rows: torch.Tensor | None = None,
    words_per_block: int = WORDS_PER_BLOCK,
) -> None:
    """logits[rows[i], t] = -inf wherever bitmask[i] disallows token t, in place (see
    `kernels.token_bitmask.apply_token_bitmask_`). All three on one device; logits [num_rows, vocab]
    with contiguous rows, bitmask int32 [n, words] with contiguous rows, rows int64 [n] or None.
    Rows outside logits are skipped. `words_per_block` is a power of two (the tests make it small)."""
    n, words = bitmask.shape
    num_rows, vocab = logits.shape
    if n == 0 or vocab == 0:
        return
    if logits.stride(1) != 1 or bitmask.stride(1) != 1:
        raise ValueError(
            "triton_apply_token_bitmask_ needs logits and bitmask contiguous in their last dimension"
        )
    grid = (n, triton.cdiv(vocab, 32 * words_per_block))
    apply_token_bitmask_kernel[grid](
        logits,
        bitmask,
        # Without rows the kernel reads none; any pointer stands in.
        rows if rows is not None else bitmask,
        num_rows,
        vocab,
        words,
        logits.stride(0),
        bitmask.stride(0),
        HAS_ROWS=rows is not None,
        WORDS_PER_BLOCK=words_per_block,
    )


def kernel_interpreted() -> bool:
    """Whether the kernel was made for Triton's interpreter (TRITON_INTERPRET=1 at import)."""
    return isinstance(apply_token_bitmask_kernel, InterpretedFunction)
