"""Paged attention through flash-attn 2 (the `gpu` extra) on CUDA.

Decodes go through `flash_attn_with_kvcache` with a block table; prefill chunks go through
`flash_attn_varlen_func`, over their own new keys when no chunk has cached context, else over the
paged cache through its `block_table` argument (flash-attn >= 2.6), which covers prefix-cache hits
and chunked prefill in one call.

Layout: a layer's cache is [2, kv_heads, num_blocks, block_size, head_dim] (kernels/cache_ops.py);
flash-attn's paged mode wants [num_blocks, block_size, kv_heads, head_dim]. `cache[i].permute(1, 2,
0, 3)` is that shape without a copy: flash-attn takes a block's offset from the tensor's stride(0),
a token's from stride(-3) and a head's from stride(-2), and asserts only that the last dimension is
contiguous (`k_cache.stride(-1) == 1`), so the permuted view is read in place.

Its paged KV needs a block size that is a multiple of 256 (the docstring of flash_attn_with_kvcache
and the check in its `mha_fwd_kvcache`); `flash_attn_unavailable_reason` says so before a step
runs. flash_attn is imported only when the backend runs: the CPU machine does not have it.

A layer's sliding window and soft cap are flash-attn's own `window_size=(window - 1, 0)` (a query
sees itself and the window - 1 keys before it; flash-attn skips the pages wholly before that, which
the KV cache manager may have freed) and `softcap` (0: none), on both paths.

The decode path reads only device tensors (no host lists), so a CUDA graph can capture it.
"""

from __future__ import annotations

import importlib.util
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import Tensor

from kernels.attention.metadata import AttentionMetadata
from kernels.attention.params import AttentionParams
from kernels.cache_ops import reshape_and_cache

# flash-attn's paged KV cache reads pages of a multiple of this many tokens.
FLASH_ATTN_PAGE_MULTIPLE = 256


def flash_attn_unavailable_reason(device: torch.device, block_size: int) -> str | None:
    """None when this backend can run on `device` with `block_size`; else one line saying why not."""
    if device.type != "cuda":
        return f"flash-attn runs on CUDA only, the device is {device.type}"
    if importlib.util.find_spec("flash_attn") is None:
        return "flash-attn is not installed (pip install 'raypage[gpu]' or flash-attn)"
    if block_size % FLASH_ATTN_PAGE_MULTIPLE:
        return f"flash-attn's paged KV needs block_size % {FLASH_ATTN_PAGE_MULTIPLE} == 0, got {block_size}"
    return None


def paged_views(kv_cache: Tensor) -> tuple[Tensor, Tensor]:
    """The key and value caches as [num_blocks, block_size, kv_heads, head_dim] views (no copy)."""
    return kv_cache[0].permute(1, 2, 0, 3), kv_cache[1].permute(1, 2, 0, 3)


def _flash_attn() -> ModuleType:
    import flash_attn  # optional, CUDA-only: imported when the backend first runs

    return flash_attn


def flash_attn_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    kv_cache: Tensor,
    meta: AttentionMetadata,
    params: AttentionParams,
) -> Tensor:
    """Store the new keys and values, then attend decodes and prefill chunks with flash-attn."""
    reshape_and_cache(key, value, kv_cache, meta.slot_mapping)
    fa = _flash_attn()
    key_cache, value_cache = paged_views(kv_cache)
    out = torch.empty_like(query)
    num_decodes = meta.num_decodes
    if num_decodes:
        decoded = fa.flash_attn_with_kvcache(
            query[:num_decodes].unsqueeze(1),  # [seqs, 1 query token, heads, dim]
            key_cache,
            value_cache,
            cache_seqlens=meta.seq_lens[:num_decodes].to(torch.int32),
            block_table=meta.block_table[:num_decodes].to(torch.int32),
            causal=True,
            **_layer_options(params),
        )
        out[:num_decodes] = decoded.squeeze(1)
    if num_decodes < meta.num_seqs:
        first = meta.query_start_loc[num_decodes]
        out[first:] = _prefill(fa, query, key, value, key_cache, value_cache, meta, params)
    return out


def _layer_options(params: AttentionParams) -> dict[str, object]:
    """flash-attn's arguments for the layer's scale, sliding window and soft cap."""
    window = params.sliding_window
    return dict(
        softmax_scale=params.scale,
        window_size=(-1, -1) if window is None else (window - 1, 0),
        softcap=params.soft_cap_or_zero,
    )


def _prefill(
    fa: ModuleType,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    key_cache: Tensor,
    value_cache: Tensor,
    meta: AttentionMetadata,
    params: AttentionParams,
) -> Tensor:
    """The prefill chunks (every sequence after the decodes) in one varlen call; causal is
    bottom-right aligned in flash-attn, so query row r of a chunk with context c sees keys 0..c + r."""
    num_decodes, first = meta.num_decodes, meta.query_start_loc[meta.num_decodes]
    query_lens = [meta.query_len(i) for i in range(num_decodes, meta.num_seqs)]
    seq_lens = meta.seq_lens_list[num_decodes:]
    # Offsets on the device already (no host list copied over, which would wait for the stream).
    cu_seqlens_q = meta.query_start_loc_tensor[num_decodes:] - first
    common = dict(causal=True, max_seqlen_q=max(query_lens), **_layer_options(params))
    if query_lens == seq_lens:  # no cached context anywhere: attend over the new keys as they came
        return fa.flash_attn_varlen_func(
            query[first:],
            key[first:],
            value[first:],
            cu_seqlens_q=cu_seqlens_q,
            cu_seqlens_k=cu_seqlens_q,
            max_seqlen_k=max(seq_lens),
            **common,
        )
    return fa.flash_attn_varlen_func(
        query[first:],
        key_cache,
        value_cache,
        cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_k=F.pad(meta.seq_lens[num_decodes:].cumsum(0), (1, 0)).to(torch.int32),
        max_seqlen_k=max(seq_lens),
        block_table=meta.block_table[num_decodes:].to(torch.int32),
        **common,
    )


# Its decode path reads only device tensors, so engine/worker/cuda_graphs.py may capture it.
flash_attn_attention.cuda_graph_safe = True  # type: ignore[attr-defined]
