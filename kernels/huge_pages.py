"""Zeroed host tensors backed by transparent huge pages, for the paged KV cache.

Decode attention reads each sequence's blocks where they lie, scattered across a cache of a hundred
megabytes or more per layer. With 4 KB pages nearly every 2 KB block read is also a TLB miss, and
the page walk (two-dimensional in a VM) comes before the row's own trip to memory; with 2 MB pages
the walks mostly vanish. Many distributions run transparent huge pages in `madvise` mode, where the
kernel backs a region with them only when asked (`madvise(MADV_HUGEPAGE)`), so the cache asks.

Best effort: off Linux, for a non-CPU device, for small tensors, or when `madvise` fails (THP
`never`, a kernel without it), the tensor is an ordinary `torch.zeros`.
"""

from __future__ import annotations

import ctypes
import sys

import torch

HUGE_PAGE_BYTES = 2 << 20
MADV_HUGEPAGE = 14  # <linux/mman.h>


def _advise_huge_pages(address: int, length: int) -> bool:
    """madvise(MADV_HUGEPAGE) over the 2 MB-aligned pages inside [address, address + length)."""
    start = -(-address // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
    end = (address + length) // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES
    if end <= start:
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc.madvise(start, end - start, MADV_HUGEPAGE) == 0


def zeros_on_huge_pages(*shape: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """torch.zeros(shape), its memory advised onto huge pages before it is first touched where possible."""
    if torch.device(device).type != "cpu" or not sys.platform.startswith("linux"):
        return torch.zeros(*shape, dtype=dtype, device=device)
    tensor = torch.empty(*shape, dtype=dtype, device=device)
    # Before the zeroing: the page faults it takes are what allocate the (huge) pages. A region that
    # is not 2 MB-aligned keeps 4 KB pages at its ends, a few MB out of hundreds.
    _advise_huge_pages(tensor.data_ptr(), tensor.numel() * tensor.element_size())
    return tensor.zero_()
