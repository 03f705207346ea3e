"""The AMX kernel (torch.ops.raypage.amx_paged_attention) against the reference backend on random
paged batches: decodes of every length from 1 to 300, fresh prefills, chunks over cached context
and mixed batches; GQA groups from 1 to 32, head_dim 32 to 128, blocks of 16 and 32 tokens, NaNs in
the slots past each length, strided views; then the `cpu_paged` backend's choice of it. Skipped
where the CPU lacks AMX-BF16."""

from __future__ import annotations

import pytest
import torch

from kernels.attention import AttentionParams, cpu_paged
from kernels.attention.cpu_paged import amx_serves, cpu_paged_attention
from kernels.attention.reference import reference_attention
from kernels.build import cpu_kernels_available
from kernels.cache_ops import reshape_and_cache
from tests.kernels.random_batch import PagedBatch, random_paged_batch

pytestmark = pytest.mark.skipif(
    not (cpu_kernels_available() and torch.ops.raypage.amx_attention_serves(64, 16)),
    reason="no AMX-BF16 here (CPU or kernel), or the C++ kernels could not be built",
)

KV_HEADS = 2
TOL = 2e-2  # bf16 outputs, as the other kernels' tests


def batch(specs, group, head_dim=64, block_size=16, seed=0) -> PagedBatch:
    return random_paged_batch(
        specs,
        heads=KV_HEADS * group,
        kv_heads=KV_HEADS,
        head_dim=head_dim,
        block_size=block_size,
        dtype=torch.bfloat16,
        device=torch.device("cpu"),
        seed=seed,
    )


def amx_attention(pb: PagedBatch, out: torch.Tensor | None = None) -> torch.Tensor:
    """The new tokens' keys and values stored, then the kernel over the whole batch."""
    reshape_and_cache(pb.key, pb.value, pb.kv_cache, pb.meta.slot_mapping)
    out = torch.full_like(pb.query, float("nan")) if out is None else out
    meta, scale = pb.meta, pb.query.shape[-1] ** -0.5
    torch.ops.raypage.amx_paged_attention(
        out, pb.query, pb.kv_cache, meta.block_table, meta.seq_lens, meta.query_start_loc_tensor, scale
    )
    return out


def expected(pb: PagedBatch) -> torch.Tensor:
    scale = pb.query.shape[-1] ** -0.5
    return reference_attention(
        pb.query, pb.key, pb.value, pb.kv_cache.clone(), pb.meta, AttentionParams(scale)
    )


@pytest.mark.parametrize("group", [1, 3, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", [16, 32])
def test_decodes_of_every_length_match_reference(group, head_dim, block_size):
    specs = [(length - 1, 1) for length in range(300, 0, -1)]  # longest first, as the model runner sorts
    pb = batch(specs, group, head_dim, block_size)
    torch.testing.assert_close(amx_attention(pb), expected(pb), rtol=TOL, atol=TOL)


# Decodes, fresh prompts of 1 to 300 tokens (whole tiles and not), and chunks after whole and
# partial blocks of cached context, in one batch.
DECODES = [(70, 1), (16, 1), (3, 1), (0, 1)]
PROMPTS = [(0, 5), (0, 16), (0, 37), (0, 300)]
CHUNKS = [(100, 37), (16, 16), (255, 130)]
PREFILLS = DECODES + PROMPTS + CHUNKS


@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", [16, 32])
def test_prefills_and_chunks_over_cached_context_match_reference(group, head_dim, block_size):
    pb = batch(PREFILLS, group, head_dim, block_size, seed=1)
    torch.testing.assert_close(amx_attention(pb), expected(pb), rtol=TOL, atol=TOL)


@pytest.mark.parametrize(
    ("group", "head_dim"),
    [(16, 64), (32, 64), (5, 32), (6, 96)],
    ids=["group16-rows-streamed", "group32-decodes-packed", "dim32", "dim96"],
)
def test_other_groups_and_head_sizes_match_reference(group, head_dim):
    # A decode of up to 16 rows streams its keys, one of 32 packs them as prefill chunks do.
    pb = batch([(200, 1), (31, 1), (0, 1), (0, 40), (47, 9)], group, head_dim, seed=2)
    torch.testing.assert_close(amx_attention(pb), expected(pb), rtol=TOL, atol=TOL)


@pytest.mark.parametrize("block_size", [16, 32])
def test_slots_past_each_length_are_never_read_into_the_result(block_size):
    # What earlier sequences left there: NaN here. Keys go by tiles of 16 and values by pairs, so
    # odd lengths, and chunks of both kinds of item (up to 16 rows, more), are the test.
    specs = [(46, 1), (32, 1), (16, 1), (2, 1), (0, 3), (0, 33), (20, 45)]
    pb = batch(specs, 3, block_size=block_size, seed=3)
    reference = expected(pb)
    for row, seq_len in enumerate(pb.meta.seq_lens_list):
        last = pb.meta.block_table[row, (seq_len - 1) // block_size]
        pb.kv_cache[:, :, last, seq_len % block_size or block_size :] = float("nan")
    out = amx_attention(pb)
    assert not out.isnan().any()
    torch.testing.assert_close(out, reference, rtol=TOL, atol=TOL)


def test_strided_query_output_and_block_table():
    # query and out as views of wider rows (as the fused QKV projection's output), the block table
    # every other column of a wider one.
    pb = batch([(90, 1), (9, 1), (0, 20), (33, 14)], 3, seed=4)
    reference = expected(pb)
    tokens, heads, dim = pb.query.shape
    wide = torch.zeros(tokens, heads + 4, dim, dtype=torch.bfloat16)
    wide[:, 2 : heads + 2] = pb.query
    table = torch.full((pb.meta.num_seqs, 2 * pb.meta.block_table.shape[1]), 10**6)
    table[:, ::2] = pb.meta.block_table
    pb.query, pb.meta.block_table = wide[:, 2 : heads + 2], table[:, ::2]
    out_rows = torch.full((tokens, heads + 1, dim), float("nan"), dtype=torch.bfloat16)
    out = amx_attention(pb, out_rows[:, 1:])
    torch.testing.assert_close(out, reference, rtol=TOL, atol=TOL)
    assert out_rows[:, 0].isnan().all()  # nothing written outside the view


def test_the_backend_takes_the_amx_kernel_for_bf16_and_keeps_the_other_paths_otherwise(monkeypatch):
    pb = batch(PREFILLS, 3, seed=5)
    assert amx_serves(pb.kv_cache)
    reference = expected(pb)
    scale = pb.query.shape[-1] ** -0.5
    monkeypatch.setattr(cpu_paged, "tiled_serves", lambda query, kv_cache: pytest.fail("took another path"))
    out = cpu_paged_attention(pb.query, pb.key, pb.value, pb.kv_cache, pb.meta, AttentionParams(scale))
    torch.testing.assert_close(out, reference, rtol=TOL, atol=TOL)
    cache = pb.kv_cache
    assert not amx_serves(cache.float())  # float32 and float16 caches
    assert not amx_serves(cache.half())
    assert not amx_serves(torch.zeros(2, 2, 4, 16, 80, dtype=torch.bfloat16))  # head_dim 80
    assert not amx_serves(torch.zeros(2, 2, 4, 8, 64, dtype=torch.bfloat16))  # blocks of 8


def test_bad_arguments_raise_naming_the_problem():
    pb = batch([(20, 1), (0, 7)], 3)
    meta = pb.meta

    def call(query=pb.query, kv_cache=pb.kv_cache, table=meta.block_table, lens=meta.seq_lens, starts=None):
        starts = meta.query_start_loc_tensor if starts is None else starts
        out = torch.empty_like(query)
        torch.ops.raypage.amx_paged_attention(out, query, kv_cache, table, lens, starts, 1.0)

    with pytest.raises(RuntimeError, match="must be bfloat16"):
        call(query=pb.query.float())
    with pytest.raises(RuntimeError, match="needs more blocks"):
        call(lens=meta.seq_lens * 10)
    with pytest.raises(RuntimeError, match="out of range"):
        call(table=torch.full_like(meta.block_table, 10**6))
    with pytest.raises(RuntimeError, match="query rows but seq_lens"):
        call(lens=torch.tensor([21, 3]))
    with pytest.raises(RuntimeError, match="query_start_loc must"):
        call(starts=meta.query_start_loc_tensor.long())
    with pytest.raises(RuntimeError, match="not served here"):
        call(
            query=torch.zeros(8, 6, 80, dtype=torch.bfloat16),
            kv_cache=torch.zeros(2, 2, 8, 16, 80).bfloat16(),
        )
