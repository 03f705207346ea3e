"""The flash-attn backend: why it cannot run (on the CPU machine), its paged views of the cache, and
(on CUDA with flash-attn installed) its output and cache writes against kernels/attention/reference.py."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from kernels.attention.flash_attn import flash_attn_attention, flash_attn_unavailable_reason, paged_views
from kernels.attention.metadata import AttentionMetadata
from kernels.attention.reference import reference_attention

CUDA = torch.device("cuda")


def test_not_on_the_cpu():
    assert flash_attn_unavailable_reason(torch.device("cpu"), 256) == (
        "flash-attn runs on CUDA only, the device is cpu"
    )


@pytest.mark.skipif(importlib.util.find_spec("flash_attn") is not None, reason="flash-attn is installed")
def test_not_without_flash_attn():
    assert "flash-attn is not installed" in flash_attn_unavailable_reason(CUDA, 256)


def test_block_size_must_be_a_multiple_of_256(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    # An importable (empty) flash_attn package, so that the check reaches the block size.
    (tmp_path / "flash_attn").mkdir()
    (tmp_path / "flash_attn" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert flash_attn_unavailable_reason(CUDA, 16) == (
        "flash-attn's paged KV needs block_size % 256 == 0, got 16"
    )
    assert flash_attn_unavailable_reason(CUDA, 512) is None


def test_paged_views_read_the_cache_in_place():
    cache = torch.randn(2, 3, 5, 4, 8)  # [2, kv_heads, blocks, block_size, dim]
    keys, values = paged_views(cache)
    assert keys.shape == (5, 4, 3, 8) and keys.stride(-1) == 1
    assert keys.data_ptr() == cache.data_ptr()  # a view, not a copy
    torch.testing.assert_close(keys[2, 1, 0], cache[0, 0, 2, 1])
    torch.testing.assert_close(values[4, 3, 2], cache[1, 2, 4, 3])


def random_batch(specs: list[tuple[int, int]], block_size: int, dtype: torch.dtype, device: torch.device):
    """(context, query_len) per sequence on a random cache with scattered blocks: the context's keys
    are whatever the cache holds, as after earlier steps."""
    heads, kv_heads, dim = 8, 2, 64
    gen = torch.Generator().manual_seed(0)
    widths = [-(-(c + q) // block_size) for c, q in specs]
    blocks = torch.randperm(sum(widths) + 2, generator=gen).tolist()
    table = torch.zeros(len(specs), max(widths), dtype=torch.long)
    for i, width in enumerate(widths):
        table[i, :width] = torch.tensor([blocks.pop() for _ in range(width)])
    slots = [
        int(table[i, pos // block_size]) * block_size + pos % block_size
        for i, (c, q) in enumerate(specs)
        for pos in range(c, c + q)
    ]
    num_tokens = sum(q for _, q in specs)
    cache = torch.randn(2, kv_heads, sum(widths) + 2, block_size, dim, generator=gen).to(device, dtype)
    query, key, value = (
        torch.randn(num_tokens, h, dim, generator=gen).to(device, dtype) for h in (heads, kv_heads, kv_heads)
    )
    starts = [0]
    for _, q in specs:
        starts.append(starts[-1] + q)
    seq_lens = [c + q for c, q in specs]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, device=device),
        block_table=table.to(device),
        seq_lens=torch.tensor(seq_lens, device=device),
        query_start_loc=starts,
        seq_lens_list=seq_lens,
        num_decodes=next((i for i, (_, q) in enumerate(specs) if q != 1), len(specs)),
        block_size=block_size,
    )
    return query, key, value, cache, meta


@pytest.mark.gpu
@pytest.mark.skipif(importlib.util.find_spec("flash_attn") is None, reason="needs flash-attn")
@pytest.mark.parametrize(
    "specs",
    [
        [(700, 1), (300, 1), (0, 1)],  # decodes only
        [(0, 300), (0, 17)],  # fresh prefills only: varlen over the new keys
        [(900, 1), (5, 1), (0, 40), (300, 260), (511, 2)],  # decodes, a fresh prefill, chunks with context
    ],
)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_flash_attn_equals_the_reference(specs, dtype):
    query, key, value, cache, meta = random_batch(specs, 256, dtype, CUDA)
    expected_cache = cache.clone()
    expected = reference_attention(query, key, value, expected_cache, meta, 64**-0.5)
    out = flash_attn_attention(query, key, value, cache, meta, 64**-0.5)
    torch.testing.assert_close(out, expected, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(cache, expected_cache, rtol=0, atol=0)
