"""Zeroed host tensors backed by transparent huge pages, for the paged KV cache.

Decode attention reads each sequence's blocks where they lie, scattered across a cache of a hundred
megabytes or more per layer. With 4 KB pages nearly every 2 KB block read is also a TLB miss, and
the page walk (two-dimensional in a VM) comes before the row's own trip to memory; with 2 MB pages
the walks mostly vanish. Many distributions run transparent huge pages in `madvise` mode, where the
kernel backs a region with them only when asked (`madvise(MADV_HUGEPAGE)`), so the cache asks.

Best effort: off Linux, for a non-CPU device, or for tensors under one huge page, the tensor is an
ordinary `torch.zeros`; where `madvise` fails (THP `never`, a kernel without it) it is zeroed memory
on ordinary pages.

The pages are allocated (and zeroed by the kernel) at their first write, or ahead of it by
`prefault_in_background`: faulting in a cache of a GiB takes seconds, which a server would
otherwise spend before it answers its first request. The background faults keep out of the steps'
way: each huge page's fault costs a core (in a VM, the host's backing of the page too), and on two
cores a step running beside them took three times as long (batch 1 right after start, 2026-12-06),
so they run only while this process has run no step for `PREFAULT_IDLE_SECONDS`
(`engine_step` marks the steps); a page a step writes first, it faults in itself.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import math
import mmap
import sys
import threading
import time
from collections.abc import Iterator, Sequence

import torch

logger = logging.getLogger(__name__)

HUGE_PAGE_BYTES = 2 << 20
# What one call faults in: a few huge pages, a few milliseconds, the longest a step that starts
# meanwhile (or an allocation waiting for the memory map) waits for it.
PREFAULT_CHUNK_BYTES = 4 * HUGE_PAGE_BYTES
# How long after a step the background faults resume: longer than the host's work between two
# steps, so that they run between requests, not between the steps of one.
PREFAULT_IDLE_SECONDS = 0.05
MADV_HUGEPAGE = 14  # <linux/mman.h>
MADV_POPULATE_WRITE = 23


def _advise_huge_pages(address: int, length: int) -> bool:
    """madvise(MADV_HUGEPAGE) over the 2 MB-aligned pages inside [address, address + length)."""
    start = -(-address // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
    end = (address + length) // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES
    if end <= start:
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc.madvise(start, end - start, MADV_HUGEPAGE) == 0


def _populate(address: int, length: int) -> int:
    """madvise(MADV_POPULATE_WRITE) over the pages of [address, address + length) (Linux 5.14+): 0,
    or the errno (EINVAL where the kernel does not know the advice)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return 0 if libc.madvise(address, length, MADV_POPULATE_WRITE) == 0 else ctypes.get_errno()


def zeros_on_huge_pages(*shape: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """torch.zeros(shape), its memory advised onto huge pages before it is first touched where possible."""
    numel = math.prod(shape)
    nbytes = numel * dtype.itemsize
    if torch.device(device).type != "cpu" or not sys.platform.startswith("linux") or nbytes < HUGE_PAGE_BYTES:
        return torch.zeros(*shape, dtype=dtype, device=device)
    # A private anonymous mapping of its own (a shared one would be shmem, off THP): zero pages from
    # the kernel, never memory freed by someone else, so no zeroing pass of our own (it doubled the
    # cost of the page faults). The tensor holds the mapping, which is unmapped with the last
    # reference to it.
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE)
    tensor = torch.frombuffer(region, dtype=dtype, count=numel).view(shape)
    # Advised before the first touch: the page faults are what allocate the (huge) pages. A region
    # that is not 2 MB-aligned keeps 4 KB pages at its ends, a few MB out of hundreds.
    _advise_huge_pages(tensor.data_ptr(), nbytes)
    return tensor


_PREFAULT_THREAD = "kv-prefault"


class _StepActivity:
    """Whether this process is running a step, and since when it is not."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._running = 0
        self._last_end = -math.inf

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        with self._changed:
            self._running += 1
        try:
            yield
        finally:
            with self._changed:
                self._running -= 1
                self._last_end = time.monotonic()
                self._changed.notify_all()

    def wait_until_idle(self, idle_seconds: float) -> None:
        """Return once no step runs and none has for `idle_seconds`."""
        with self._changed:
            while True:
                if self._running:
                    self._changed.wait()
                    continue
                left = self._last_end + idle_seconds - time.monotonic()
                if left <= 0:
                    return
                self._changed.wait(left)


_STEPS = _StepActivity()


def engine_step() -> contextlib.AbstractContextManager[None]:
    """Marks a step of the engine running in this process: background prefaults wait for it to end
    and for `PREFAULT_IDLE_SECONDS` after it."""
    return _STEPS.step()


def prefault_in_background(tensors: Sequence[torch.Tensor]) -> threading.Thread:
    """Fault in the pages of the CPU `tensors` on a daemon thread, as a first write to each would,
    leaving their contents as they are: other threads may read and write them meanwhile (a page
    they touch first is simply faulted in by them). Rather than at a request's first write into each
    page; without blocking the start-up, which would wait seconds per GiB of zeroed pages; and only
    while no step runs (`engine_step`). Where the kernel cannot (before Linux 5.14), the pages
    fault in at their first writes."""
    thread = threading.Thread(target=_prefault, args=(list(tensors),), name=_PREFAULT_THREAD, daemon=True)
    thread.start()
    return thread


def wait_for_prefaults() -> None:
    """Return once every background prefault of this process is done: benchmarks time the steady
    state, not the start-up, whose page faults compete for the cores and the memory map."""
    for thread in threading.enumerate():
        if thread.name == _PREFAULT_THREAD:
            thread.join()


def _prefault(tensors: list[torch.Tensor]) -> None:
    # ctypes lets go of the GIL during the call: the kernel's work runs beside the Python threads.
    for tensor in tensors:
        if tensor.device.type != "cpu" or not sys.platform.startswith("linux"):
            continue
        error = _populate_in_chunks(tensor.data_ptr(), tensor.numel() * tensor.element_size())
        if error == errno.EINVAL:
            return
        if error:
            # ENOMEM on a host without the memory: the allocation itself stands (overcommitted), so
            # this warns before the first requests that would fault the missing pages.
            logger.warning(
                "could not fault in %d MB of KV cache: %s", tensor.nbytes >> 20, errno.errorcode[error]
            )


def _populate_in_chunks(address: int, length: int) -> int:
    """`_populate` a few huge pages at a time, while the engine idles: faulting in holds the process's
    memory map, which every new mapping (a large tensor the engine allocates for its first requests)
    would otherwise wait for until the whole tensor is in, and takes a core from the steps."""
    for start in range(0, length, PREFAULT_CHUNK_BYTES):
        _STEPS.wait_until_idle(PREFAULT_IDLE_SECONDS)
        error = _populate(address + start, min(PREFAULT_CHUNK_BYTES, length - start))
        if error:
            return error
    return 0
