"""Sliding windows and soft caps in the CPU attention paths: the C++ decode kernel (both of its
loops) and the tiled prefill kernel called directly, the `cpu_paged` backend on mixed batches, and,
for every backend that runs here, that blocks wholly before a window (which the KV cache manager
frees and may hand to another sequence) are never read. The reference against dense attention and
the sdpa backend are in test_attention.py, Triton in test_triton_attention.py."""

from __future__ import annotations

import pytest
import torch

from kernels.attention import AttentionParams, cpu_paged, get_attention_backend
from kernels.attention.cpu_paged import cpu_attention_path, cpu_paged_attention
from kernels.attention.reference import reference_attention
from kernels.build import cpu_kernels_available
from kernels.cache_ops import reshape_and_cache
from tests.kernels.random_batch import PagedBatch, random_paged_batch
from tests.kernels.test_cpu_paged import HEAD_DIM, TOLERANCE, decode_batch

needs_kernels = pytest.mark.skipif(
    not cpu_kernels_available(), reason="the C++ CPU kernels could not be built here (no compiler or ninja)"
)

# (window, soft cap): a window inside a block, one of exactly a block, a one-token window, a cap.
WINDOWS_AND_CAPS = [(37, None), (16, None), (1, None), (None, 1.5), (29, 2.0)]
IDS = ["window-37", "window-16", "window-1", "soft-cap", "window-and-cap"]
# Decodes over contexts past the windows, a fresh prompt longer than them, chunks after contexts of
# whole and partial blocks.
SPECS = [(90, 1), (47, 1), (16, 1), (2, 1), (0, 70), (100, 37), (33, 16), (5, 2)]


def paged_batch(dtype: torch.dtype, group: int = 3, seed: int = 0) -> PagedBatch:
    return random_paged_batch(
        SPECS, heads=2 * group, kv_heads=2, head_dim=HEAD_DIM, block_size=16, dtype=dtype,
        device=torch.device("cpu"), seed=seed,
    )  # fmt: skip


def reference(pb: PagedBatch, params: AttentionParams) -> torch.Tensor:
    return reference_attention(pb.query, pb.key, pb.value, pb.kv_cache.clone(), pb.meta, params)


@needs_kernels
@pytest.mark.parametrize(("window", "soft_cap"), WINDOWS_AND_CAPS, ids=IDS)
@pytest.mark.parametrize(
    ("dtype", "group"),
    [(torch.float32, 3), (torch.bfloat16, 3), (torch.bfloat16, 5)],
    ids=["fp32-widened", "bf16-vdpbf16ps", "bf16-widened-group5"],
)
def test_decode_kernel_matches_reference(dtype, group, window, soft_cap):
    # Every length: windows starting at every offset of a block, odd and even (the bf16 loop pairs
    # tokens from an even one).
    seq_lens = list(range(70, 0, -1))
    query, cache, meta = decode_batch(seq_lens, group, 16, dtype)
    params = AttentionParams(HEAD_DIM**-0.5, window, soft_cap)
    empty = torch.zeros(0, cache.shape[1], HEAD_DIM, dtype=dtype)
    expected = reference_attention(query, empty, empty, cache, meta, params)
    out = torch.full_like(query, float("nan"))
    torch.ops.raypage.paged_decode_attention(
        out,
        query,
        cache,
        meta.block_table,
        meta.seq_lens,
        params.scale,
        window=window or 0,
        soft_cap=soft_cap or 0,
    )
    torch.testing.assert_close(out, expected, rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])


@needs_kernels
@pytest.mark.parametrize(("window", "soft_cap"), WINDOWS_AND_CAPS, ids=IDS)
@pytest.mark.parametrize("group", [1, 3])
def test_tiled_prefill_kernel_matches_reference(group, window, soft_cap):
    if not torch.ops.raypage.tiled_attention_serves(HEAD_DIM, group, 16):
        pytest.skip("the tiled kernel needs AVX-512 BF16")
    pb = paged_batch(torch.bfloat16, group)
    params = AttentionParams(HEAD_DIM**-0.5, window, soft_cap)
    expected = reference(pb, params)
    reshape_and_cache(pb.key, pb.value, pb.kv_cache, pb.meta.slot_mapping)
    out = torch.full_like(pb.query, float("nan"))
    meta = pb.meta
    torch.ops.raypage.tiled_prefill_attention(
        out, pb.query, pb.kv_cache, meta.block_table, meta.seq_lens, meta.query_start_loc_tensor, params.scale,
        window=window or 0, soft_cap=soft_cap or 0,
    )  # fmt: skip
    torch.testing.assert_close(out, expected, rtol=2e-2, atol=2e-2)


@needs_kernels
@pytest.mark.parametrize(("window", "soft_cap"), WINDOWS_AND_CAPS, ids=IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_paged_backend_matches_reference(dtype, window, soft_cap):
    pb = paged_batch(dtype)
    params = AttentionParams(HEAD_DIM**-0.5, window, soft_cap)
    expected = reference(pb, params)
    out = cpu_paged_attention(pb.query, pb.key, pb.value, pb.kv_cache, pb.meta, params)
    torch.testing.assert_close(out, expected, rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])


@needs_kernels
def test_windowed_and_capped_layers_skip_the_amx_and_cascade_paths(monkeypatch):
    # Where AMX and cascade would serve a plain layer, a windowed or capped one takes the kernels
    # that honour both.
    monkeypatch.setattr(cpu_paged, "amx_serves", lambda kv_cache: True)
    monkeypatch.setattr(cpu_paged, "tiled_serves", lambda query, kv_cache: True)
    monkeypatch.setattr(cpu_paged, "cascade_blocks", lambda meta: 4)
    pb = paged_batch(torch.bfloat16)
    for params in (AttentionParams(1.0, sliding_window=8), AttentionParams(1.0, logits_soft_cap=5.0)):
        assert cpu_attention_path("decode", pb.query, pb.kv_cache, pb.meta, params) == "paged_decode"
        assert cpu_attention_path("prefill", pb.query, pb.kv_cache, pb.meta, params) == "tiled_prefill"
    assert cpu_attention_path("decode", pb.query, pb.kv_cache, pb.meta, AttentionParams(1.0)) == "amx"


def poison_blocks_before_the_window(pb: PagedBatch, window: int) -> None:
    """Point every table entry wholly before each sequence's first visible key at a block of NaNs,
    as a freed block reused by another sequence would be: a backend that reads one returns NaN."""
    used = set(pb.meta.block_table.flatten().tolist())
    poison = next(block for block in range(pb.kv_cache.shape[2]) if block not in used)
    pb.kv_cache[:, :, poison] = float("nan")
    params = AttentionParams(1.0, window)
    for i in range(pb.meta.num_seqs):
        context = pb.meta.seq_lens_list[i] - pb.meta.query_len(i)
        pb.meta.block_table[i, : params.first_visible(context) // pb.meta.block_size] = poison


BACKENDS = [
    ("reference", torch.float32),
    ("sdpa", torch.float32),
    ("sdpa", torch.bfloat16),
    ("cpu_paged", torch.float32),
    ("cpu_paged", torch.bfloat16),
    ("triton", torch.float32),
]


@pytest.mark.parametrize(("name", "dtype"), BACKENDS, ids=[f"{n}-{str(d)[6:]}" for n, d in BACKENDS])
def test_blocks_wholly_before_the_window_are_never_read(name, dtype):
    if name == "cpu_paged" and not cpu_kernels_available():
        pytest.skip("the C++ CPU kernels could not be built here")
    pb = paged_batch(dtype, seed=1)
    params = AttentionParams(HEAD_DIM**-0.5, sliding_window=20, logits_soft_cap=3.0)
    expected = reference(pb, params)
    poison_blocks_before_the_window(pb, 20)
    out = get_attention_backend(name)(pb.query, pb.key, pb.value, pb.kv_cache, pb.meta, params)
    assert not out.isnan().any()
    torch.testing.assert_close(out, expected, rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])
