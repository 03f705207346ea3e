"""The Triton attention backend: reshape-and-cache, then the paged attention kernels
(kernels/attention/triton_kernels.py) for the decodes, with split-K over long contexts, and for the
prefill chunks.

Triton's kernels run on CUDA tensors, or on CPU tensors in Triton's interpreter when
TRITON_INTERPRET=1 was set before triton was imported (how the test suite runs them without a GPU).
`kernels.attention.selector` imports this module only when the backend is asked for.
"""

from __future__ import annotations

import functools

import torch
import triton
from torch import Tensor

from kernels.attention.metadata import AttentionMetadata
from kernels.attention.triton_kernels import kernels_interpreted, paged_attention_rows
from kernels.triton_cache import triton_reshape_and_cache

# Powers of two only (tl.arange), and at least tl.dot's smallest tile dimension.
MIN_BLOCK_SIZE = 16
# A split covers at least this many tokens: below it merging costs more than the parallelism gains.
MIN_SPLIT_TOKENS = 256
MAX_SPLITS = 32


def triton_unavailable_reason(device: torch.device, block_size: int) -> str | None:
    """Why the Triton kernels cannot run on `device` with this block size; None when they can."""
    if block_size < MIN_BLOCK_SIZE or block_size & (block_size - 1):
        return f"block_size {block_size} is not a power of two >= {MIN_BLOCK_SIZE}"
    if device.type == "cuda":
        return None if torch.cuda.is_available() else "torch sees no CUDA device"
    if kernels_interpreted():
        return None
    if triton.knobs.runtime.interpret:
        return "TRITON_INTERPRET=1 was set after the Triton kernels were imported; set it before triton is"
    return (
        f"needs CUDA tensors, or TRITON_INTERPRET=1 (set before triton is imported) to run on "
        f"{device.type} tensors in Triton's interpreter"
    )


def triton_attention(
    query: Tensor, key: Tensor, value: Tensor, kv_cache: Tensor, meta: AttentionMetadata, scale: float
) -> Tensor:
    """Store the new keys and values, then attend the decode rows and the prefill chunks."""
    triton_reshape_and_cache(key, value, kv_cache, meta.slot_mapping)
    out = torch.empty_like(query)
    num_decodes = meta.num_decodes
    rows = (out, query, kv_cache, meta.block_table, meta.seq_lens, meta.query_start_loc_tensor)
    if num_decodes:
        longest = max(meta.seq_lens_list[:num_decodes])
        splits = decode_num_splits(num_decodes, kv_cache.shape[1], longest, query.device)
        paged_attention_rows(*rows, range(num_decodes), 1, scale, splits)
    if num_decodes < meta.num_seqs:
        prefills = range(num_decodes, meta.num_seqs)
        paged_attention_rows(*rows, prefills, max(meta.query_len(i) for i in prefills), scale)
    return out


def decode_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, device: torch.device) -> int:
    """How many splits each decode's blocks get: enough programs to fill the device, none shorter
    than MIN_SPLIT_TOKENS."""
    wanted = triton.cdiv(_target_programs(device), num_seqs * num_kv_heads)
    return max(1, min(wanted, triton.cdiv(max_seq_len, MIN_SPLIT_TOKENS), MAX_SPLITS))


@functools.cache
def _target_programs(device: torch.device) -> int:
    # Two waves of programs per streaming multiprocessor; the interpreter (on the CPU) has no such
    # count, and a few programs let the tests' longer decodes split.
    if device.type == "cuda":
        return 2 * torch.cuda.get_device_properties(device).multi_processor_count
    return 8
