"""kernels.huge_pages: the KV cache's allocator hands back zeroed, usable memory whether or not the host
gives it huge pages (THP may be off, or in `madvise` mode, here)."""

from __future__ import annotations

import pytest
import torch

from kernels.huge_pages import HUGE_PAGE_BYTES, engine_step, prefault_in_background, zeros_on_huge_pages


@pytest.mark.parametrize("elements", [1000, 3 * HUGE_PAGE_BYTES // 2 + 777])  # under one huge page; several
def test_zeroed_even_where_freed_memory_held_nans(elements):
    # Freed memory full of NaNs, likely to be handed out again for the same size: the cache must not
    # start with it, since padded reads of never-written slots would turn it into NaN outputs.
    freed = torch.full((elements,), float("nan"), dtype=torch.bfloat16)
    del freed
    cache = zeros_on_huge_pages(2, elements, dtype=torch.bfloat16)
    assert cache.shape == (2, elements) and cache.dtype == torch.bfloat16 and cache.is_contiguous()
    assert torch.count_nonzero(cache) == 0
    cache[1, -5:] = 3.0  # writable to the end, past the advised span
    assert cache.sum().item() == 15.0


def test_prefault_keeps_what_was_written_before_and_during_it():
    # Requests may write the cache while its pages are faulted in behind them: nothing written is lost.
    cache = zeros_on_huge_pages(4, HUGE_PAGE_BYTES, dtype=torch.bfloat16)
    cache[0, :7] = 2.0
    thread = prefault_in_background([cache])
    cache[3, -3:] = 5.0
    thread.join(timeout=60)
    assert not thread.is_alive()
    assert cache.sum().item() == 7 * 2.0 + 3 * 5.0
    assert torch.count_nonzero(cache) == 10


def test_prefault_waits_while_a_step_runs():
    # The faults take a core the step's threads need: they run between steps, not beside them.
    cache = zeros_on_huge_pages(2, HUGE_PAGE_BYTES, dtype=torch.bfloat16)
    with engine_step():
        thread = prefault_in_background([cache])
        cache[1, -1] = 4.0
        thread.join(timeout=0.5)
        assert thread.is_alive()  # waiting for the step to end
    thread.join(timeout=60)
    assert not thread.is_alive()
    assert cache.sum().item() == 4.0
