"""The int8 KV cache (kv_cache_dtype="int8") at the kernel level: reshape_and_cache's quantized rows
against a quantization written here, the int8 attention kernel against float32 softmax attention over
the dequantized cache (decodes and prefill chunks in one batch, GQA, windows, soft caps, scattered
blocks and a strided block table, blocks before a window never read), the cpu_paged backend's whole step against the same and against
the bf16 cache, and the torch paths' refusal of an int8 cache."""

from __future__ import annotations

import pytest
import torch

from kernels.attention import AttentionParams
from kernels.attention.cpu_paged import cpu_attention_path, cpu_paged_attention
from kernels.attention.metadata import AttentionMetadata
from kernels.attention.reference import reference_attention
from kernels.build import cpu_kernels_available
from kernels.cache_ops import cache_row_width, gather_blocks, reshape_and_cache
from tests.kernels.random_batch import PagedBatch, random_paged_batch

pytestmark = pytest.mark.skipif(
    not cpu_kernels_available(), reason="the C++ CPU kernels could not be built here (no compiler or ninja)"
)

# Decodes over contexts of whole and partial blocks (one of a single token), a fresh prompt of
# several items' rows, chunks after cached contexts.
SPECS = [(90, 1), (47, 1), (16, 1), (0, 1), (0, 70), (100, 37), (33, 16), (5, 2)]
# (window, soft cap): none, a window inside a block, one of exactly a block, one token, a cap, both.
WINDOWS_AND_CAPS = [(None, None), (37, None), (16, None), (1, None), (None, 1.5), (29, 2.0)]
IDS = ["plain", "window-37", "window-16", "window-1", "soft-cap", "window-and-cap"]


def quantize(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows [..., head_dim] as (int8 values, float32 scales [...]): scale = max |x| / 127 and
    value = x / scale rounded half to even (torch.round), 0 for a row of zeros."""
    x = rows.float()
    scale = x.abs().amax(-1) / 127
    ratio = torch.where(scale[..., None] > 0, x / scale[..., None], torch.zeros_like(x))
    return ratio.round().to(torch.int8), scale


def int8_cache(cache: torch.Tensor) -> torch.Tensor:
    """A float cache [2, kv_heads, blocks, block_size, head_dim] in the int8 layout: each row's values,
    then its scale's 4 bytes."""
    values, scale = quantize(cache)
    return torch.cat([values, scale[..., None].view(torch.int8)], dim=-1).contiguous()


def quantized(rows: torch.Tensor) -> torch.Tensor:
    """Rows [..., head_dim] after a round trip through int8: each quantized value times its scale."""
    values, scale = quantize(rows)
    return values.float() * scale[..., None]


def dequantize(cache: torch.Tensor) -> torch.Tensor:
    """An int8 cache's rows as float32 [2, kv_heads, blocks, block_size, head_dim]: values times scale."""
    values, scale = cache[..., :-4], cache[..., -4:].contiguous().view(torch.float32)
    return values.float() * scale


def dense_attention(
    query: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata, params: AttentionParams
) -> torch.Tensor:
    """Float32 softmax attention of every query row over its sequence's dequantized keys and values,
    one sequence at a time: causal to the row's position, inside the window, scores soft-capped."""
    dense = dequantize(cache)
    group = query.shape[1] // cache.shape[1]
    out = torch.empty(query.shape, dtype=torch.float32)
    for i in range(meta.num_seqs):
        start, end, seq_len = meta.query_start_loc[i], meta.query_start_loc[i + 1], meta.seq_lens_list[i]
        blocks = meta.block_table[i, : -(-seq_len // meta.block_size)]
        keys, values = dense.index_select(2, blocks).flatten(2, 3)[:, :, :seq_len]  # [kv_heads, seq_len, dim]
        keys, values = keys.repeat_interleave(group, 0), values.repeat_interleave(group, 0)
        q = query[start:end].float().transpose(0, 1)  # [heads, rows, dim]
        scores = q @ keys.transpose(1, 2) * params.scale
        if params.logits_soft_cap is not None:
            scores = torch.tanh(scores / params.logits_soft_cap) * params.logits_soft_cap
        positions = torch.arange(seq_len - (end - start), seq_len)[:, None]
        keys_at = torch.arange(seq_len)[None, :]
        visible = keys_at <= positions
        if params.sliding_window is not None:
            visible &= keys_at > positions - params.sliding_window
        probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
        out[start:end] = (probs @ values).transpose(0, 1)
    return out


def int8_batch(dtype: torch.dtype, group: int, head_dim: int, block_size: int, seed: int = 0) -> PagedBatch:
    """SPECS over a random int8 cache with 2 KV heads, the blocks scattered, the block table a strided
    view (every other column of a wider table, the rest out of range)."""
    pb = random_paged_batch(
        SPECS, heads=2 * group, kv_heads=2, head_dim=head_dim, block_size=block_size, dtype=dtype,
        device=torch.device("cpu"), seed=seed,
    )  # fmt: skip
    pb.kv_cache = int8_cache(pb.kv_cache.float())
    table = pb.meta.block_table
    wide = torch.full((table.shape[0], 2 * table.shape[1]), pb.kv_cache.shape[2] + 1000)
    wide[:, ::2] = table
    pb.meta.block_table = wide[:, ::2]
    return pb


@pytest.mark.parametrize(("window", "soft_cap"), WINDOWS_AND_CAPS, ids=IDS)
@pytest.mark.parametrize(
    ("dtype", "group", "head_dim", "block_size"),
    [
        (torch.float32, 1, 64, 16),
        (torch.float32, 3, 72, 16),  # head_dim past whole vectors: the one-at-a-time tails
        (torch.bfloat16, 4, 64, 32),
        (torch.bfloat16, 8, 128, 16),  # 4 rows per item
        (torch.float16, 5, 32, 8),
    ],
    ids=["fp32-g1", "fp32-g3-d72", "bf16-g4-b32", "bf16-g8-d128", "fp16-g5-b8"],
)
def test_int8_kernel_matches_float_attention_over_the_dequantized_cache(
    dtype, group, head_dim, block_size, window, soft_cap
):
    pb = int8_batch(dtype, group, head_dim, block_size)
    params = AttentionParams(head_dim**-0.5, window, soft_cap)
    expected = dense_attention(pb.query, pb.kv_cache, pb.meta, params)
    if window is not None:
        # Blocks wholly before every row's window may be freed and handed on: never read (an id out
        # of range would be an error).
        for i in range(pb.meta.num_seqs):
            first_position = pb.meta.seq_lens_list[i] - pb.meta.query_len(i)
            pb.meta.block_table[i, : max(first_position - window + 1, 0) // block_size] = -1
    out = torch.full_like(pb.query, float("nan"))
    torch.ops.raypage.int8_paged_attention(
        out,
        pb.query,
        pb.kv_cache,
        pb.meta.block_table,
        pb.meta.seq_lens,
        pb.meta.query_start_loc_tensor,
        params.scale,
        window=params.window_or_zero,
        soft_cap=params.soft_cap_or_zero,
    )
    # float32 throughout, in another order; otherwise the output's one rounding to its dtype.
    tolerance = 1e-4 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.float(), expected, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 40])
def test_reshape_and_cache_stores_the_rows_quantized_with_their_scales(dtype, head_dim):
    kv_heads, blocks, block = 3, 6, 16
    gen = torch.Generator().manual_seed(head_dim)
    tokens = 20
    # Views into a fused QKV projection's output, as the model passes them.
    qkv = (torch.randn(tokens, 4 * kv_heads * head_dim, generator=gen) * 3).to(dtype)
    key = qkv[:, kv_heads * head_dim : 2 * kv_heads * head_dim].view(tokens, kv_heads, head_dim)
    value = qkv[:, 2 * kv_heads * head_dim : 3 * kv_heads * head_dim].view(tokens, kv_heads, head_dim)
    key[3, 1] = 0  # a row of zeros: scale 0, values 0
    slots = torch.randperm(blocks * block, generator=gen)[:tokens]
    cache = torch.full(
        (2, kv_heads, blocks, block, cache_row_width(head_dim, torch.int8)), 7, dtype=torch.int8
    )
    want = cache.clone()
    for kv, rows in enumerate((key, value)):
        values, scale = quantize(rows)
        for token, slot in enumerate(slots.tolist()):
            want[kv, :, slot // block, slot % block, :head_dim] = values[token]
            want[kv, :, slot // block, slot % block, head_dim:] = scale[token, :, None].view(torch.int8)
    reshape_and_cache(key, value, cache, slots)
    assert torch.equal(cache, want)  # every stored byte, and nothing outside the slots touched


def test_quantization_rounds_halves_to_even():
    # max |x| = 127 makes the scale exactly 1, so x / scale is x: halves land on the rounding ties.
    row = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.4, -3.6] + [0.0] * 7)
    key = row.view(1, 1, 16)
    cache = torch.zeros(2, 1, 1, 16, 20, dtype=torch.int8)
    reshape_and_cache(key, key, cache, torch.tensor([5]))
    assert cache[0, 0, 0, 5, :9].tolist() == [127, 0, 2, 2, 0, -2, -2, 3, -4]
    assert cache[0, 0, 0, 5, 16:].view(torch.float32).item() == 1.0


def test_a_slot_outside_an_int8_cache_is_refused_and_nothing_written():
    key = torch.randn(3, 2, 32)
    cache = torch.zeros(2, 2, 4, 8, 36, dtype=torch.int8)
    with pytest.raises(RuntimeError, match="slot 32 of token 2 is outside the cache's 32 slots"):
        reshape_and_cache(key, key, cache, torch.tensor([0, 5, 32]))
    assert not cache.any()


def step_batch(dtype: torch.dtype, group: int, window: int | None) -> tuple[PagedBatch, AttentionParams]:
    head_dim = 64
    pb = random_paged_batch(
        SPECS, heads=2 * group, kv_heads=2, head_dim=head_dim, block_size=16, dtype=dtype,
        device=torch.device("cpu"),
    )  # fmt: skip
    return pb, AttentionParams(head_dim**-0.5, window)


@pytest.mark.parametrize("window", [None, 37])
@pytest.mark.parametrize("group", [1, 3])
def test_a_whole_step_stores_the_new_rows_and_attends_on_the_int8_path(group, window):
    pb, params = step_batch(torch.bfloat16, group, window)
    cache = int8_cache(pb.kv_cache.float())
    assert cpu_attention_path("decode", pb.query, cache, pb.meta, params) == "int8"
    assert cpu_attention_path("prefill", pb.query, cache, pb.meta, params) == "int8"
    out = cpu_paged_attention(pb.query, pb.key, pb.value, cache, pb.meta, params)
    # The reference: this test's quantization of the step's rows written into the cache by hand.
    expected_cache = int8_cache(pb.kv_cache.float())
    for kv, rows in enumerate((pb.key, pb.value)):
        values, scale = quantize(rows)
        slots = expected_cache[kv].view(2, -1, cache.shape[-1])  # [kv_heads, slots, row]
        slots[:, pb.meta.slot_mapping, :-4] = values.transpose(0, 1)
        slots[:, pb.meta.slot_mapping, -4:] = scale.transpose(0, 1)[..., None].view(torch.int8)
    assert torch.equal(cache, expected_cache)
    expected = dense_attention(pb.query, expected_cache, pb.meta, params)
    torch.testing.assert_close(out.float(), expected, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("window", [None, 37])
def test_int8_kv_against_bf16_kv(window):
    """The same step over a bf16 cache and over its int8 quantization, each against float32 attention
    over the bf16 cache: the int8 cache's error is at most the sum of the bf16 kernel's own rounding
    and the quantization's, the latter measured by float32 attention over the dequantized rows (the
    bf16 kernel's rounding depends on the CPU: bf16 dot products with AVX-512 BF16, float32 without),
    and at most about one quantization step for any output."""
    pb, params = step_batch(torch.bfloat16, 3, window)
    bf16_cache, cache = pb.kv_cache.clone(), int8_cache(pb.kv_cache.float())
    with_bf16 = cpu_paged_attention(pb.query, pb.key, pb.value, bf16_cache, pb.meta, params).float()
    with_int8 = cpu_paged_attention(pb.query, pb.key, pb.value, cache, pb.meta, params).float()
    exact = reference_attention(
        pb.query.float(), pb.key.float(), pb.value.float(), bf16_cache.float(), pb.meta, params
    )
    over_quantized = reference_attention(
        pb.query.float(), quantized(pb.key), quantized(pb.value), dequantize(int8_cache(pb.kv_cache.float())),
        pb.meta, params,
    )  # fmt: skip

    def rms(error: torch.Tensor) -> float:
        return error.pow(2).mean().sqrt().item()

    quantization, rounding = rms(over_quantized - exact), rms(with_bf16 - exact)
    assert rms(with_int8 - exact) < 1.25 * (quantization + rounding)
    assert rms(with_int8 - exact) < 0.015 * exact.std()
    # A row's step is max |x| / 127; these rows' largest |x| is about 4.
    assert (with_int8 - exact).abs().max() < 0.03


def test_the_torch_paths_refuse_an_int8_cache():
    pb, params = step_batch(torch.float32, 1, None)
    cache = int8_cache(pb.kv_cache)
    with pytest.raises(ValueError, match="kv_cache_dtype='int8'"):
        reference_attention(pb.query, pb.key, pb.value, cache, pb.meta, params)
    with pytest.raises(ValueError, match="kv_cache_dtype='int8'"):
        gather_blocks(cache, torch.tensor([0, 1]))
