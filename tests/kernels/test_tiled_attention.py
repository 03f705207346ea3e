"""The tiled prefill kernel (torch.ops.raypage.tiled_prefill_attention, AVX-512 BF16) against the
reference backend: GQA groups of 1-8, head sizes 32-128, blocks of 16 and 32; chunks of every length
around the 16-token tiles, after cached contexts of whole and partial blocks; slots past each
sequence's end holding NaN; row-strided query views; and the shapes it does not take. Then cascade
decode attention over a prefix many rows share, through the kernel and through the backend."""

from __future__ import annotations

import pytest
import torch

from kernels.attention import AttentionParams
from kernels.attention.cpu_paged import cascade_blocks, cpu_paged_attention
from kernels.attention.reference import reference_attention
from kernels.build import cpu_kernels_available
from kernels.cache_ops import reshape_and_cache
from tests.kernels.random_batch import PagedBatch, random_paged_batch

pytestmark = pytest.mark.skipif(
    not (cpu_kernels_available() and torch.ops.raypage.tiled_attention_serves(64, 3, 16)),
    reason="the tiled kernel needs AVX-512 BF16 (and the C++ kernels built)",
)

BF16 = torch.bfloat16
TOL = 2e-2  # scores and probabilities rounded to bf16, as the reference rounds them
# (context, new tokens): fresh prompts shorter and longer than a tile, chunks after whole and
# partial blocks, a chunk of one token among prefills, a long chunk over a long context.
SPECS = [(0, 1), (0, 15), (0, 16), (0, 17), (16, 16), (5, 2), (100, 37), (33, 64), (0, 130), (250, 301)]


def batch(group: int, head_dim: int = 64, block_size: int = 16, specs=SPECS, seed: int = 0) -> PagedBatch:
    return random_paged_batch(
        specs, heads=2 * group, kv_heads=2, head_dim=head_dim, block_size=block_size, dtype=BF16,
        device=torch.device("cpu"), seed=seed,
    )  # fmt: skip


def tiled(pb: PagedBatch, out: torch.Tensor | None = None) -> torch.Tensor:
    """The batch's new keys and values stored, then every sequence's rows through the kernel."""
    reshape_and_cache(pb.key, pb.value, pb.kv_cache, pb.meta.slot_mapping)
    out = torch.full_like(pb.query, float("nan")) if out is None else out
    meta = pb.meta
    torch.ops.raypage.tiled_prefill_attention(
        out, pb.query, pb.kv_cache, meta.block_table, meta.seq_lens, meta.query_start_loc_tensor,
        pb.query.shape[-1] ** -0.5,
    )  # fmt: skip
    return out


def expected(pb: PagedBatch) -> torch.Tensor:
    scale = pb.query.shape[-1] ** -0.5
    return reference_attention(
        pb.query, pb.key, pb.value, pb.kv_cache.clone(), pb.meta, AttentionParams(scale)
    )


@pytest.mark.parametrize("group", [1, 2, 3, 4, 6, 8])
@pytest.mark.parametrize(("head_dim", "block_size"), [(64, 16), (32, 32), (128, 16)])
def test_tiled_kernel_matches_reference(group: int, head_dim: int, block_size: int) -> None:
    pb = batch(group, head_dim, block_size, seed=group)
    want = expected(pb)
    got = tiled(pb)
    assert not got.isnan().any()
    torch.testing.assert_close(got, want, rtol=TOL, atol=TOL)


def test_cache_slots_past_each_sequence_are_never_read_into_the_result() -> None:
    # The kernel reads keys 8 at a time and values in pairs, past a sequence's end within its last
    # block: NaN there must not reach any output (odd lengths are the test).
    pb = batch(3, specs=[(0, 17), (20, 13), (0, 1), (3, 30)], seed=3)
    want = expected(pb)
    reshape_and_cache(pb.key, pb.value, pb.kv_cache, pb.meta.slot_mapping)
    for row, seq_len in enumerate(pb.meta.seq_lens_list):
        last = pb.meta.block_table[row, (seq_len - 1) // 16]
        pb.kv_cache[:, :, last, seq_len % 16 or 16 :] = float("nan")
    got = tiled(pb)
    assert not got.isnan().any()
    torch.testing.assert_close(got, want, rtol=TOL, atol=TOL)


def test_query_and_out_may_be_row_strided_views() -> None:
    # The query is a view into the QKV projection's output in the model: rows further apart than
    # their heads; the output too may be a view.
    pb = batch(3, specs=[(7, 40), (0, 20)], seed=4)
    want = expected(pb)
    tokens, heads, dim = pb.query.shape
    wide = torch.randn(tokens, heads + 3, dim, dtype=BF16)
    wide[:, 1 : heads + 1] = pb.query
    pb.query = wide[:, 1 : heads + 1]
    out_rows = torch.full((tokens, heads + 1, dim), float("nan"), dtype=BF16)
    got = tiled(pb, out_rows[:, 1:])
    torch.testing.assert_close(got, want, rtol=TOL, atol=TOL)
    assert out_rows[:, 0].isnan().all()  # nothing written outside the view


def test_shapes_it_is_not_built_for_are_declined_and_refused() -> None:
    serves = torch.ops.raypage.tiled_attention_serves
    assert serves(64, 3, 16) and serves(128, 8, 32)
    assert not serves(80, 3, 16)  # head_dim
    assert not serves(64, 5, 16)  # group
    assert not serves(64, 3, 8)  # blocks of 8
    pb = batch(3, specs=[(0, 4)])
    meta = pb.meta
    with pytest.raises(RuntimeError, match="must be bf16"):
        torch.ops.raypage.tiled_prefill_attention(
            pb.query.float(), pb.query.float(), pb.kv_cache, meta.block_table, meta.seq_lens,
            meta.query_start_loc_tensor, 1.0,
        )  # fmt: skip
    with pytest.raises(RuntimeError, match="out of range"):
        torch.ops.raypage.tiled_prefill_attention(
            torch.empty_like(pb.query), pb.query, pb.kv_cache, torch.full_like(meta.block_table, 10**6),
            meta.seq_lens, meta.query_start_loc_tensor, 1.0,
        )  # fmt: skip
    with pytest.raises(RuntimeError, match="cannot hold"):
        torch.ops.raypage.tiled_prefill_attention(
            torch.empty_like(pb.query), pb.query, pb.kv_cache, meta.block_table, meta.seq_lens * 100,
            meta.query_start_loc_tensor, 1.0,
        )  # fmt: skip


def shared_prefix_decodes(num_seqs: int, shared_blocks: int, seed: int = 0) -> PagedBatch:
    """Decode rows whose tables begin with the same `shared_blocks` blocks (sequence 0's), each with
    1-40 tokens of its own past them; the decodes' new keys and values stored."""
    own = [1 + (7 * i) % 40 for i in range(num_seqs)]
    pb = random_paged_batch(
        [(shared_blocks * 16 + n - 1, 1) for n in own], heads=9, kv_heads=3, head_dim=64, block_size=16,
        dtype=BF16, device=torch.device("cpu"), seed=seed,
    )  # fmt: skip
    pb.meta.block_table[:, :shared_blocks] = pb.meta.block_table[0, :shared_blocks].clone()
    reshape_and_cache(pb.key, pb.value, pb.kv_cache, pb.meta.slot_mapping)
    return pb


@pytest.mark.parametrize(("num_seqs", "shared_blocks"), [(1, 1), (16, 8), (37, 3), (64, 24)])
def test_cascade_decodes_match_reference(num_seqs: int, shared_blocks: int) -> None:
    pb = shared_prefix_decodes(num_seqs, shared_blocks, seed=num_seqs)
    want = expected(pb)
    meta = pb.meta
    assert num_seqs < 2 or meta.shared_decode_blocks >= shared_blocks  # one row shares with none
    # NaN past every sequence's end: neither part may read it into a result.
    for row, seq_len in enumerate(meta.seq_lens_list):
        pb.kv_cache[:, :, meta.block_table[row, (seq_len - 1) // 16], seq_len % 16 or 16 :] = float("nan")
    got = torch.full_like(pb.query, float("nan"))
    torch.ops.raypage.cascade_decode_attention(
        got, pb.query, pb.kv_cache, meta.block_table, meta.seq_lens, shared_blocks, 0.125
    )
    assert not got.isnan().any()
    # The two parts' probabilities are rounded to bf16 each against its own sum, then merged in float32.
    torch.testing.assert_close(got, want, rtol=TOL, atol=TOL)


def test_cascade_refuses_rows_that_do_not_share_the_prefix() -> None:
    pb = shared_prefix_decodes(4, 3)
    pb.meta.block_table[2, 1] = pb.meta.block_table[0, 1] + 1
    with pytest.raises(RuntimeError, match="sequence 2 does not hold the first 3 blocks"):
        torch.ops.raypage.cascade_decode_attention(
            torch.empty_like(pb.query), pb.query, pb.kv_cache, pb.meta.block_table, pb.meta.seq_lens, 3, 0.125
        )


def test_the_backend_attends_a_shared_prefix_once_for_many_decodes() -> None:
    pb = shared_prefix_decodes(20, 9)
    meta = pb.meta
    assert cascade_blocks(meta) == meta.shared_decode_blocks >= 9
    want = expected(pb)
    got = cpu_paged_attention(pb.query, pb.key, pb.value, pb.kv_cache, meta, AttentionParams(0.125))
    torch.testing.assert_close(got, want, rtol=TOL, atol=TOL)
    # Few rows, or a short prefix, attend the usual way.
    assert cascade_blocks(shared_prefix_decodes(8, 9).meta) == 0
    assert cascade_blocks(shared_prefix_decodes(20, 2).meta) == 0
