"""The C++ decode kernel (torch.ops.raypage.paged_decode_attention) against the reference backend:
float32, bf16 and float16 caches, GQA groups of 1, 3 and 4, blocks of 16 and 32, every length from
1 to 300, scattered blocks and a strided block table; then whole mixed batches through the
`cpu_paged` backend, and the backend selection."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from kernels.attention import AttentionMetadata, AttentionParams, cpu_paged, get_attention_backend
from kernels.attention.cpu_paged import cpu_paged_attention
from kernels.attention.reference import reference_attention
from kernels.attention.sdpa import sdpa_attention
from kernels.build import cpu_kernels_available
from tests.kernels.random_batch import random_paged_batch
from tests.kernels.test_attention import MIXED, SCALE, build_batch

needs_kernels = pytest.mark.skipif(
    not cpu_kernels_available(), reason="the C++ CPU kernels could not be built here (no compiler or ninja)"
)

HEAD_DIM = 64


def tiled_prefill_serves() -> bool:
    return torch.ops.raypage.tiled_attention_serves(HEAD_DIM, 3, 16)


TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


def decode_batch(seq_lens, group, block_size, dtype, kv_heads=2, seed=0, head_dim=HEAD_DIM):
    """Decode rows over a random cache: each sequence's blocks scattered at random, the block table a
    strided view (every other column of a wider table), its unused entries pointing out of range."""
    gen = torch.Generator().manual_seed(seed)
    widths = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(widths) + 7
    cache = torch.randn(2, kv_heads, num_blocks, block_size, head_dim, generator=gen).to(dtype)
    wide = torch.full((len(seq_lens), 2 * max(widths)), num_blocks + 1000)
    blocks = torch.randperm(num_blocks, generator=gen).tolist()
    for row, width in enumerate(widths):
        wide[row, : 2 * width : 2] = torch.tensor([blocks.pop() for _ in range(width)])
    table = wide[:, ::2]
    assert not table.is_contiguous()
    query = torch.randn(len(seq_lens), kv_heads * group, head_dim, generator=gen).to(dtype)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(0, dtype=torch.long),
        block_table=table,
        seq_lens=torch.tensor(seq_lens),
        query_start_loc=list(range(len(seq_lens) + 1)),
        seq_lens_list=list(seq_lens),
        num_decodes=len(seq_lens),
        block_size=block_size,
    )
    return query, cache, meta


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("block_size", [16, 32])
def test_decode_kernel_matches_reference(dtype, group, block_size):
    seq_lens = list(range(300, 0, -1))  # every length, exact block multiples included, longest first
    query, cache, meta = decode_batch(seq_lens, group, block_size, dtype)
    empty = torch.zeros(0, cache.shape[1], HEAD_DIM, dtype=dtype)
    scale = HEAD_DIM**-0.5
    expected = reference_attention(query, empty, empty, cache, meta, AttentionParams(scale))
    out = torch.full_like(query, float("nan"))
    torch.ops.raypage.paged_decode_attention(out, query, cache, meta.block_table, meta.seq_lens, scale)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out, expected, rtol=tol, atol=tol)


@needs_kernels
@pytest.mark.parametrize(
    ("head_dim", "group", "block_size"),
    [(128, 4, 16), (32, 8, 16), (64, 5, 16), (64, 3, 8), (80, 3, 16)],
    ids=["vdpbf16ps-dim128", "vdpbf16ps-dim32", "widened-group5", "widened-block8", "widened-dim80"],
)
def test_bf16_shapes_on_either_kernel_match_reference(head_dim, group, block_size):
    # The first two take the vdpbf16ps kernel (where the CPU has AVX-512 BF16), the rest the
    # widening one: a group, block size or head size the bf16 kernel is not built for.
    seq_lens = list(range(130, 0, -1))
    query, cache, meta = decode_batch(seq_lens, group, block_size, torch.bfloat16, head_dim=head_dim)
    empty = torch.zeros(0, cache.shape[1], head_dim, dtype=torch.bfloat16)
    expected = reference_attention(query, empty, empty, cache, meta, AttentionParams(head_dim**-0.5))
    out = torch.empty_like(query)
    torch.ops.raypage.paged_decode_attention(
        out, query, cache, meta.block_table, meta.seq_lens, head_dim**-0.5
    )
    torch.testing.assert_close(out, expected, rtol=2e-2, atol=2e-2)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cache_slots_past_each_length_are_never_read_into_the_result(dtype):
    # Slots past a sequence's length hold whatever earlier sequences left there: NaN here. The
    # bf16 kernel reads keys and values in pairs and in tiles of 16, so odd lengths are the test.
    seq_lens = [47, 33, 17, 16, 3, 1]
    query, cache, meta = decode_batch(seq_lens, group=3, block_size=16, dtype=dtype)
    empty = torch.zeros(0, cache.shape[1], HEAD_DIM, dtype=dtype)
    expected = reference_attention(query, empty, empty, cache, meta, AttentionParams(0.125))
    for row, seq_len in enumerate(seq_lens):
        last = meta.block_table[row, (seq_len - 1) // 16]
        cache[:, :, last, seq_len % 16 or 16 :] = float("nan")
    out = torch.empty_like(query)
    torch.ops.raypage.paged_decode_attention(out, query, cache, meta.block_table, meta.seq_lens, 0.125)
    assert not out.isnan().any()
    torch.testing.assert_close(out, expected, rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])


@needs_kernels
def test_decode_rows_need_not_be_sorted():
    query, cache, meta = decode_batch([5, 300, 17, 64], group=3, block_size=16, dtype=torch.float32)
    empty = torch.zeros(0, cache.shape[1], HEAD_DIM)
    expected = reference_attention(query, empty, empty, cache, meta, AttentionParams(0.125))
    out = torch.empty_like(query)
    torch.ops.raypage.paged_decode_attention(out, query, cache, meta.block_table, meta.seq_lens, 0.125)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mixed_batch_through_the_backend_matches_reference(dtype):
    # decodes, a fresh prefill and chunks with cached context, as the model runner batches them
    q, k, v, cache, meta, _ = build_batch(MIXED, dtype=dtype)
    expected = reference_attention(q, k, v, cache.clone(), meta, SCALE)
    out = cpu_paged_attention(q, k, v, cache, meta, SCALE)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out, expected, rtol=tol, atol=tol)


@needs_kernels
def test_many_decodes_through_the_backend_match_the_sdpa_backend():
    specs = [(context, 1) for context in range(40, 0, -3)]
    q, k, v, cache, meta, _ = build_batch(specs, num_blocks=256, dtype=torch.bfloat16)
    expected = sdpa_attention(q, k, v, cache.clone(), meta, SCALE)
    # Same roundings as the torch path (scores and probabilities to bf16): only summation order differs.
    torch.testing.assert_close(cpu_paged_attention(q, k, v, cache, meta, SCALE), expected)


@needs_kernels
@pytest.mark.parametrize("tiled", [True, False], ids=["tiled", "sdpa"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_long_prefill_chunks_over_cached_context_match_reference(dtype, tiled, monkeypatch):
    # Fresh prompts, chunks after a cached context of whole and partial blocks, and decodes, in one
    # batch at SmolLM2's shapes; the prefill chunks through the tiled kernel (bf16 on AVX-512 BF16)
    # or through SDPA per chunk.
    if tiled and not (dtype == torch.bfloat16 and tiled_prefill_serves()):
        pytest.skip("the tiled kernel serves bf16 caches on CPUs with AVX-512 BF16")
    monkeypatch.setattr(cpu_paged, "tiled_serves", lambda query, kv_cache: tiled)
    specs = [(70, 1), (3, 1), (0, 130), (100, 37), (16, 16), (5, 2)]
    pb = random_paged_batch(
        specs, heads=9, kv_heads=3, head_dim=HEAD_DIM, block_size=16, dtype=dtype, device=torch.device("cpu")
    )
    scale = AttentionParams(HEAD_DIM**-0.5)
    expected = reference_attention(pb.query, pb.key, pb.value, pb.kv_cache.clone(), pb.meta, scale)
    out = cpu_paged_attention(pb.query, pb.key, pb.value, pb.kv_cache, pb.meta, scale)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out, expected, rtol=tol, atol=tol)


@needs_kernels
def test_bad_arguments_raise_naming_the_problem():
    query, cache, meta = decode_batch([20, 3], group=3, block_size=16, dtype=torch.float32)
    out = torch.empty_like(query)
    with pytest.raises(RuntimeError, match="share a dtype"):
        torch.ops.raypage.paged_decode_attention(
            out, query.bfloat16(), cache, meta.block_table, meta.seq_lens, 1.0
        )
    with pytest.raises(RuntimeError, match="needs more blocks"):
        torch.ops.raypage.paged_decode_attention(out, query, cache, meta.block_table, meta.seq_lens * 10, 1.0)
    with pytest.raises(RuntimeError, match="out of range"):
        torch.ops.raypage.paged_decode_attention(
            out, query, cache, torch.full_like(meta.block_table, 10**6), meta.seq_lens, 1.0
        )


@needs_kernels
def test_default_backend_is_cpu_paged_and_the_environment_overrides_it(monkeypatch):
    monkeypatch.delenv("RAYPAGE_ATTENTION_BACKEND", raising=False)
    assert get_attention_backend() is cpu_paged_attention
    monkeypatch.setenv("RAYPAGE_ATTENTION_BACKEND", "sdpa")
    assert get_attention_backend() is sdpa_attention
    assert get_attention_backend("reference") is reference_attention
    monkeypatch.setenv("RAYPAGE_ATTENTION_BACKEND", "flash")
    with pytest.raises(ValueError, match=r"unknown attention backend 'flash'.*RAYPAGE_ATTENTION_BACKEND"):
        get_attention_backend()


def test_without_a_compiler_the_default_falls_back_to_sdpa_with_one_log_line(tmp_path):
    # A fresh process whose PATH has neither ninja nor a compiler, and an empty kernel cache.
    script = (
        "import logging; logging.basicConfig()\n"
        "from kernels.attention import get_attention_backend\n"
        "from kernels.attention.sdpa import sdpa_attention\n"
        "assert get_attention_backend() is sdpa_attention\n"
        "assert get_attention_backend('cpu_paged') is sdpa_attention\n"
    )
    env = {**os.environ, "PATH": str(tmp_path), "RAYPAGE_KERNEL_CACHE": str(tmp_path / "kernels")}
    env.pop("RAYPAGE_ATTENTION_BACKEND", None)
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stderr.count("C++ CPU kernels unavailable, attention uses the torch sdpa path") == 1
