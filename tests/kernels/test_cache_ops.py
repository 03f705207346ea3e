"""reshape_and_cache's C++ op (kernels/csrc/cache_ops.cpp) against the layout written out slot by
slot: each token's key and value rows at block slot // block_size, offset slot % block_size of every
head, nothing else touched, and a slot outside the cache refused before anything is written."""

from __future__ import annotations

import pytest
import torch

from kernels.build import cpu_kernels_available
from kernels.cache_ops import reshape_and_cache

pytestmark = pytest.mark.skipif(
    not cpu_kernels_available(), reason="the C++ CPU kernels could not be built here"
)
KV_HEADS, DIM, BLOCKS, BLOCK = 3, 64, 10, 16


def expected_cache(
    cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slots: list[int]
) -> torch.Tensor:
    """The cache after the writes, one (token, head) row at a time in plain indexing."""
    want = cache.clone()
    for token, slot in enumerate(slots):
        for head in range(KV_HEADS):
            want[0, head, slot // BLOCK, slot % BLOCK] = key[token, head]
            want[1, head, slot // BLOCK, slot % BLOCK] = value[token, head]
    return want


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tokens", [1, 7, 150])
def test_keys_and_values_land_in_their_slots(dtype: torch.dtype, tokens: int) -> None:
    torch.manual_seed(tokens)
    # Views into a fused QKV projection's output, as the model passes them: row stride 5 heads.
    qkv = torch.randn(tokens, 5 * KV_HEADS * DIM, dtype=dtype)
    key = qkv[:, 2 * KV_HEADS * DIM : 3 * KV_HEADS * DIM].view(tokens, KV_HEADS, DIM)
    value = qkv[:, 3 * KV_HEADS * DIM : 4 * KV_HEADS * DIM].view(tokens, KV_HEADS, DIM)
    slots = torch.randperm(BLOCKS * BLOCK)[:tokens]
    cache = torch.randn(2, KV_HEADS, BLOCKS, BLOCK, DIM, dtype=dtype)
    want = expected_cache(cache, key, value, slots.tolist())
    reshape_and_cache(key, value, cache, slots)
    assert torch.equal(cache, want)


def test_keys_of_another_dtype_are_converted_to_the_caches() -> None:
    key, value = torch.randn(4, KV_HEADS, DIM), torch.randn(4, KV_HEADS, DIM)
    cache = torch.zeros(2, KV_HEADS, BLOCKS, BLOCK, DIM, dtype=torch.bfloat16)
    slots = [3, 17, 40, 159]
    want = expected_cache(cache, key.bfloat16(), value.bfloat16(), slots)
    reshape_and_cache(key, value, cache, torch.tensor(slots))
    assert torch.equal(cache, want)


@pytest.mark.parametrize("bad_slot", [BLOCKS * BLOCK, -1])
def test_a_slot_outside_the_cache_is_refused_and_nothing_written(bad_slot: int) -> None:
    key, value = torch.randn(3, KV_HEADS, DIM), torch.randn(3, KV_HEADS, DIM)
    cache = torch.zeros(2, KV_HEADS, BLOCKS, BLOCK, DIM)
    with pytest.raises(RuntimeError, match=f"slot {bad_slot} of token 2 is outside the cache's 160 slots"):
        reshape_and_cache(key, value, cache, torch.tensor([0, 5, bad_slot]))
    assert torch.count_nonzero(cache) == 0
