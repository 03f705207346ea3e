"""The Triton backend (kernels/attention/triton_*.py, kernels/triton_cache.py) against the reference
backend and a direct index_put, and a tiny Llama through it against transformers.

Without CUDA the kernels run in Triton's interpreter (tests/conftest.py sets
TRITON_INTERPRET=1); with CUDA the same tests run them on the GPU. Shapes stay small: the
interpreter runs every program of a launch in numpy, one after the other.
"""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine import LLM, SamplingParams
from kernels.attention import AttentionMetadata, AttentionParams, get_attention_backend
from kernels.attention.triton_paged import decode_num_splits, paged_attention_rows, triton_attention
from kernels.triton_cache import triton_reshape_and_cache
from tests.kernels.test_attention import build_batch
from tests.model.hf_reference import hf_greedy
from tests.model.tiny_models import write_tiny_model

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
HEAD_DIM = 16
# (context, new tokens) per sequence, in the model runner's order: decodes first, longest first (the
# first long enough to split), then a fresh prefill, a prefix-cache hit (two full blocks of context),
# and a chunk of a chunked prefill whose context ends inside a block.
BATCH = [(300, 1), (40, 1), (2, 1), (0, 21), (32, 5), (19, 12)]
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


def as_replayed_by_a_graph(meta: AttentionMetadata, num_blocks: int) -> AttentionMetadata:
    """What a CUDA graph replays: host lists that hold capture-time values (every sequence of length
    1) over a block table as wide as max_model_len (2048), padded with a spare block. Only the
    device tensors are this step's."""
    width = 2048 // meta.block_size
    table = torch.full((meta.num_seqs, width), num_blocks - 1, dtype=torch.long, device=DEVICE)
    table[:, : meta.block_table.shape[1]] = meta.block_table
    return dataclasses.replace(meta, block_table=table, seq_lens_list=[1] * meta.num_seqs)


def assert_matches_reference(
    specs,
    dtype,
    block,
    heads,
    kv_heads,
    dim=HEAD_DIM,
    *,
    as_replayed=False,
    window=None,
    soft_cap=None,
    **launch,
):
    """The Triton backend's output and cache against the reference backend's on the same batch
    (`as_replayed`: the backend sees the metadata a CUDA graph replays, the reference the true one),
    the layer sliding over `window` tokens and capping its scores at `soft_cap` if given."""
    num_blocks = sum(-(-(context + new) // block) for context, new in specs) + 8
    q, k, v, cache, meta, _ = build_batch(
        specs,
        num_blocks=num_blocks,
        dtype=dtype,
        heads=heads,
        kv_heads=kv_heads,
        dim=dim,
        block=block,
        device=DEVICE,
    )
    params = AttentionParams(dim**-0.5, window, soft_cap)
    expected_cache = cache.clone()
    expected = get_attention_backend("reference")(q, k, v, expected_cache, meta, params)
    if launch:  # the kernel alone, on the decodes
        triton_reshape_and_cache(k, v, cache, meta.slot_mapping)
        out = torch.empty_like(q)
        paged_attention_rows(
            out,
            q,
            cache,
            meta.block_table,
            meta.seq_lens,
            meta.query_start_loc_tensor,
            range(meta.num_seqs),
            1,
            params,
            **launch,
        )
    else:
        out = triton_attention(
            q, k, v, cache, as_replayed_by_a_graph(meta, num_blocks) if as_replayed else meta, params
        )
    torch.testing.assert_close(cache, expected_cache, rtol=0, atol=0)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.float(), expected.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"]
)
@pytest.mark.parametrize("block", [16, 32])
def test_mixed_batch_matches_the_reference(block, dtype):
    # GQA: 3 query heads per KV head (a group that is not a power of two).
    assert decode_num_splits(3, 2, BATCH[0][0] + 1, DEVICE) > 1  # 3 decodes over 2 KV heads
    assert_matches_reference(BATCH, dtype, block, heads=6, kv_heads=2)


@pytest.mark.parametrize("heads,kv_heads,dim", [(4, 4, 16), (8, 1, 24)], ids=["mha", "mqa-dim24"])
def test_head_layouts_match_the_reference(heads, kv_heads, dim):
    assert_matches_reference([(45, 1), (0, 7), (17, 3)], torch.float32, 16, heads, kv_heads, dim)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    ("window", "soft_cap"), [(40, None), (None, 1.5), (17, 2.0)], ids=["window", "soft-cap", "both"]
)
def test_sliding_window_and_soft_cap_match_the_reference(dtype, window, soft_cap):
    # Windows that start inside a key tile and inside a block, for decodes (the first split) and for
    # prefill rows whose tile spans the window's start.
    assert_matches_reference(BATCH, dtype, 16, heads=6, kv_heads=2, window=window, soft_cap=soft_cap)


@pytest.mark.parametrize("num_splits", [2, 5, 16])
def test_split_decodes_match_the_reference(num_splits):
    # 10, 7, 3 and 1 key tiles (32 tokens) to split; 16 splits leave many splits empty, which the
    # merge must weigh 0.
    decodes = [(300, 1), (200, 1), (70, 1), (15, 1)]
    assert_matches_reference(decodes, torch.bfloat16, 16, heads=4, kv_heads=2, num_splits=num_splits)


def test_decodes_read_no_host_side_length():
    assert triton_attention.cuda_graph_safe
    assert_matches_reference([(300, 1), (70, 1), (15, 1)], torch.float32, 16, 4, 2, as_replayed=True)


@pytest.mark.gpu
@pytest.mark.parametrize("block", [16, 32])
def test_real_sizes_match_the_reference(block):
    # Llama-3.1-8B's head layout in bf16: 16 decodes up to 4k tokens (few enough to split), a
    # prefill, a chunk after a cached prefix and one after a partial block.
    lengths = sorted(torch.randint(1, 4096, (16,), generator=torch.Generator().manual_seed(0)).tolist())
    specs = [(length, 1) for length in reversed(lengths)] + [(0, 512), (1024, 300), (77, 33)]
    assert decode_num_splits(16, 8, max(lengths) + 1, DEVICE) > 1
    assert_matches_reference(specs, torch.bfloat16, block, heads=32, kv_heads=8, dim=128)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_reshape_and_cache_matches_index_put(dtype):
    # Keys arrive in the cache's dtype, as from the model. (Converting would differ in the last bit:
    # the interpreter truncates float32 to bf16 where the GPU rounds to nearest.)
    num_blocks, block, kv_heads = 8, 16, 3
    cache = torch.randn(2, kv_heads, num_blocks, block, HEAD_DIM, device=DEVICE).to(dtype)
    key = torch.randn(5, kv_heads, HEAD_DIM, device=DEVICE).to(dtype)
    value = torch.randn(5, kv_heads, HEAD_DIM, device=DEVICE).to(dtype)
    # A negative slot is padding: nothing is written for it.
    slots = torch.tensor([3, 17, 127, -1, 64], device=DEVICE)
    expected = cache.clone()
    written = slots >= 0
    index = (slice(None), slots[written] // block, slots[written] % block)
    expected[0][index] = key[written].transpose(0, 1)
    expected[1][index] = value[written].transpose(0, 1)
    triton_reshape_and_cache(key, value, cache, slots)
    torch.testing.assert_close(cache, expected, rtol=0, atol=0)


PROMPTS = [[5, 17, 300, 42], list(range(100, 160)), [7, 8, 9]]
MAX_TOKENS = 10


def test_tiny_llama_through_triton_matches_transformers(tmp_path, caplog):
    folder = write_tiny_model(tmp_path / "model")  # 4 heads, 2 KV heads, head_dim 16
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    # A small token budget chunks the 60-token prompt; asking it again hits the prefix cache.
    caplog.set_level(logging.INFO, logger="kernels.attention.selector")
    llm = LLM(
        str(folder),
        dtype="float32",
        device=DEVICE.type,
        attention_backend="triton",
        block_size=16,
        num_kv_blocks=32,
        max_num_batched_tokens=24,
        max_num_seqs=4,
    )
    assert "attention backend: triton (attention_backend='triton')" in caplog.text
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for prompts in (PROMPTS, PROMPTS[1:2]):
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        for output, prompt in zip(outputs, prompts, strict=True):
            assert output.outputs[0].token_ids == hf_greedy(hf, prompt, MAX_TOKENS)
    assert llm.get_stats()["prefix_cache_hits"] > 0
