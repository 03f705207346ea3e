"""Paged attention: the reference against plain dense causal attention, the SDPA backend against
the reference, on batches that mix decodes, fresh prefills and chunks with cached context, with and
without a sliding window and a soft cap."""

from __future__ import annotations

import math

import pytest
import torch

from kernels.attention import AttentionParams, get_attention_backend, sdpa
from kernels.attention.sdpa import decode_chunks
from kernels.cache_ops import copy_blocks, reshape_and_cache
from tests.kernels.random_batch import specs_metadata

HEADS, KV_HEADS, DIM, BLOCK = 6, 2, 16, 4


def dense_causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    context: int,
    window: int | None = None,
    soft_cap: float | None = None,
) -> torch.Tensor:
    """Textbook attention of queries at positions context.. over keys 0.. (the last `window` of
    them, scores capped at `soft_cap`); no paging at all."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    out = torch.empty_like(q)
    for row in range(q.shape[0]):
        end = context + row + 1
        start = 0 if window is None else max(end - window, 0)
        for head in range(q.shape[1]):
            scores = k[start:end, head] @ q[row, head] / math.sqrt(q.shape[-1])
            if soft_cap is not None:
                scores = soft_cap * torch.tanh(scores / soft_cap)
            out[row, head] = torch.softmax(scores, dim=0) @ v[start:end, head]
    return out


def build_batch(
    seq_specs,
    num_blocks=64,
    seed=0,
    dtype=torch.float32,
    *,
    heads=HEADS,
    kv_heads=KV_HEADS,
    dim=DIM,
    block=BLOCK,
    device="cpu",
):
    """seq_specs: (context, query_len) per sequence. Returns everything a backend call needs,
    plus each sequence's full keys/values for the dense check. Blocks are scattered at random."""
    gen = torch.Generator().manual_seed(seed)
    cache = torch.zeros(2, kv_heads, num_blocks, block, dim, dtype=dtype)
    free = torch.randperm(num_blocks, generator=gen).tolist()
    tables, queries, new_keys, new_values, full_kv, slots = [], [], [], [], [], []
    for context, query_len in seq_specs:
        total = context + query_len
        blocks = [free.pop() for _ in range(-(-total // block))]
        tables.append(blocks)
        k = torch.randn(total, kv_heads, dim, generator=gen, dtype=dtype)
        v = torch.randn(total, kv_heads, dim, generator=gen, dtype=dtype)
        full_kv.append((k, v))
        # The context is already in the cache; the new tokens arrive with the step.
        for pos in range(context):
            cache[0, :, blocks[pos // block], pos % block] = k[pos]
            cache[1, :, blocks[pos // block], pos % block] = v[pos]
        slots += [blocks[pos // block] * block + pos % block for pos in range(context, total)]
        queries.append(torch.randn(query_len, heads, dim, generator=gen, dtype=dtype))
        new_keys.append(k[context:])
        new_values.append(v[context:])
    width = max(len(t) for t in tables)
    block_table = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    meta = specs_metadata(seq_specs, block_table, slots, block, device)
    tensors = [torch.cat(queries), torch.cat(new_keys), torch.cat(new_values), cache]
    return *(t.to(device) for t in tensors), meta, full_kv


# decodes first, longest first (as the model runner orders them), then a fresh prefill, then chunks with context
MIXED = [(12, 1), (7, 1), (0, 1), (0, 9), (5, 6), (8, 1 + 2)]
SCALE = AttentionParams(DIM**-0.5)
# Plain, a window shorter than most sequences (not a multiple of the block), a soft cap the scores
# reach (about 1 in size here), and both.
LAYER_PARAMS = [
    SCALE,
    AttentionParams(DIM**-0.5, sliding_window=5),
    AttentionParams(DIM**-0.5, logits_soft_cap=1.5),
    AttentionParams(DIM**-0.5, sliding_window=6, logits_soft_cap=2.0),
]
PARAM_IDS = ["plain", "window", "soft-cap", "window-and-cap"]


@pytest.mark.parametrize("params", LAYER_PARAMS, ids=PARAM_IDS)
def test_reference_equals_dense_attention(params):
    q, k, v, cache, meta, full_kv = build_batch(MIXED)
    out = get_attention_backend("reference")(q, k, v, cache, meta, params)
    for i, (context, _) in enumerate(MIXED):
        start, end = meta.query_start_loc[i], meta.query_start_loc[i + 1]
        expected = dense_causal_attention(
            q[start:end], *full_kv[i], context, params.sliding_window, params.logits_soft_cap
        )
        torch.testing.assert_close(out[start:end], expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("params", LAYER_PARAMS, ids=PARAM_IDS)
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_sdpa_backend_equals_reference(dtype, tol, params):
    q, k, v, cache, meta, _ = build_batch(MIXED, dtype=dtype)
    expected = get_attention_backend("reference")(q, k, v, cache.clone(), meta, params)
    out = get_attention_backend("sdpa")(q, k, v, cache, meta, params)
    torch.testing.assert_close(out, expected, rtol=tol, atol=tol)


def test_new_tokens_are_written_to_their_slots():
    q, k, v, cache, meta, full_kv = build_batch(MIXED)
    get_attention_backend("sdpa")(q, k, v, cache, meta, SCALE)
    for i, (context, query_len) in enumerate(MIXED):
        for pos in range(context + query_len):
            block = meta.block_table[i, pos // BLOCK]
            torch.testing.assert_close(cache[0, :, block, pos % BLOCK], full_kv[i][0][pos])
            torch.testing.assert_close(cache[1, :, block, pos % BLOCK], full_kv[i][1][pos])


def test_reshape_and_cache_and_copy_blocks():
    cache = torch.zeros(2, KV_HEADS, 4, BLOCK, DIM)
    key, value = torch.randn(3, KV_HEADS, DIM), torch.randn(3, KV_HEADS, DIM)
    reshape_and_cache(key, value, cache, torch.tensor([5, 6, 13]))  # block 1 offsets 1, 2; block 3 offset 1
    torch.testing.assert_close(cache[0, :, 1, 1], key[0])
    torch.testing.assert_close(cache[0, :, 1, 2], key[1])
    torch.testing.assert_close(cache[1, :, 3, 1], value[2])
    copy_blocks([cache], torch.tensor([[1, 2]]))
    torch.testing.assert_close(cache[:, :, 2], cache[:, :, 1])
    assert torch.count_nonzero(cache[:, :, 0]) == 0


def test_decode_chunks_bound_the_padded_gather():
    lens = [40, 38, 33, 20, 17, 16, 9, 3, 1]  # longest first, blocks of 4: 10, 10, 9, 5, 5, 4, 3, 1, 1
    chunks = decode_chunks(lens, BLOCK, budget=20)
    assert chunks == [(0, 2), (2, 4), (4, 8), (8, 9)]  # 2x10, 2x9, 4x5, 1x1 padded blocks
    for start, end in chunks:
        assert (end - start) * -(-lens[start] // BLOCK) <= 20 or end - start == 1
    assert decode_chunks([100], BLOCK, budget=1) == [(0, 1)]  # one row always fits, whatever its length


@pytest.mark.parametrize("params", LAYER_PARAMS, ids=PARAM_IDS)
def test_many_decodes_split_into_runs_match_the_reference(monkeypatch, params):
    monkeypatch.setattr(sdpa, "DECODE_CHUNK_BLOCKS", 6)
    specs = [(context, 1) for context in (30, 21, 17, 9, 8, 2, 0)]
    q, k, v, cache, meta, _ = build_batch(specs)
    expected = get_attention_backend("reference")(q, k, v, cache.clone(), meta, params)
    torch.testing.assert_close(get_attention_backend("sdpa")(q, k, v, cache, meta, params), expected)
