"""The flash-attn backend: why it cannot run (on the CPU machine), its paged views of the cache, and
(on CUDA with flash-attn installed) its output and cache writes against kernels/attention/reference.py."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from kernels.attention import AttentionParams
from kernels.attention.flash_attn import flash_attn_attention, flash_attn_unavailable_reason, paged_views
from kernels.attention.reference import reference_attention
from tests.kernels.random_batch import random_paged_batch

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
@pytest.mark.parametrize(
    "params",
    [AttentionParams(64**-0.5), AttentionParams(64**-0.5, sliding_window=300, logits_soft_cap=5.0)],
    ids=["plain", "window-and-soft-cap"],
)
def test_flash_attn_equals_the_reference(specs, dtype, params):
    batch = random_paged_batch(
        specs, heads=8, kv_heads=2, head_dim=64, block_size=256, dtype=dtype, device=CUDA
    )
    expected_cache = batch.kv_cache.clone()
    expected = reference_attention(batch.query, batch.key, batch.value, expected_cache, batch.meta, params)
    out = flash_attn_attention(batch.query, batch.key, batch.value, batch.kv_cache, batch.meta, params)
    torch.testing.assert_close(out, expected, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(batch.kv_cache, expected_cache, rtol=0, atol=0)
