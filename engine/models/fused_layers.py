"""Llama-shaped decoder layers run as one C++ call each, where every operator of the layer has a CPU kernel.

A decode step of a small model spends a good share of its time in Python between the operators:
about 35 per layer (norms, the four projections, rotary, the cache write, attention and their views),
each a Python call, a dispatch and its wrapper's checks. `torch.ops.raypage.llama_decoder_layer`
(kernels/csrc/decoder_layer.cpp) runs the same operators in the same order from C++, so the outputs
are the same bit for bit (tests/model/test_fused_layers.py), without the Python between them
(docs/performance.md).

A layer is fused where it is Llama's (plain attention, a SiLU MLP, no sliding window or soft cap)
and all of it runs on those kernels: the cpu_paged attention backend over a bf16 cache (never an
int8 one, which only the int8 path reads) and no AMX attention (which the C++ call does not take),
its four projections all in bf16 panels (kernels/linear.py) or all in GGUF blocks
(kernels/gguf_blocks.py), no biases but the QKV projection's, and no tensor parallelism (the
row-parallel projections' all-reduce stays in Python). Decode rows attend through the paged decode
kernel (or the cascade one, as the layer-by-layer forward would). Prefill rows need the tiled
prefill kernel built for the layer's shape (AVX-512 BF16): a layer in panels is fused only with it;
a layer in GGUF blocks, which also runs on AVX2 machines without it, is fused there for steps of
decode rows alone and runs a step with prefill rows layer by layer. A layer in GGUF blocks runs
fused up to `GEMV_MAX_ROWS` tokens a step; a larger step (a long prefill chunk) runs it layer by
layer, whose products take the int8 kernel or dequantized panels as
`kernels.quant_linear.gemv_serves` says. Anywhere else the layer's own forward runs.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.forward_context import get_forward_context
from engine.models.decoder import Attention, DecoderLayer, GatedMLP
from kernels.attention import AttentionBackend
from kernels.attention.cpu_paged import amx_serves, cascade_blocks, cpu_paged_attention, tiled_serves
from kernels.gguf_blocks import BlockLinearWeight
from kernels.quant_linear import GEMV_MAX_ROWS

# A projection's weight as the C++ call takes it: its tensors, and the (ggml_type, rows) of each
# GGUF pack (empty for panels).
ProjectionArgs = tuple[list[torch.Tensor], list[int]]


def projection_args(weight: torch.Tensor | BlockLinearWeight) -> ProjectionArgs:
    """A projection's weight, in panels or GGUF blocks, as kernels/csrc/decoder_layer.cpp takes it."""
    if isinstance(weight, BlockLinearWeight):
        tensors = [tensor for pack in weight.packs for tensor in (pack.quants, pack.scales)]
        return tensors, [value for pack in weight.packs for value in (pack.ggml_type, pack.shape[0])]
    return [weight], []


class FusedDecoderLayer:
    """One DecoderLayer's weights and shapes, called as `layer(positions, hidden, residual)`."""

    def __init__(self, layer: DecoderLayer, prefills_fused: bool) -> None:
        attention, mlp = layer.self_attn, layer.mlp
        # Without the tiled prefill kernel a step with prefill rows runs layer by layer, and decode
        # rows never take the cascade kernel (it is the tiled kernel's too).
        self.prefills_fused = prefills_fused
        self.layer_index = attention.attn.layer_index
        self.num_heads, self.num_kv_heads = attention.num_heads, attention.num_kv_heads
        self.scale = attention.attn.scale
        self.eps = layer.input_layernorm.eps
        self.rotary = attention.rotary_emb
        self.input_norm = layer.input_layernorm.weight
        self.post_norm = layer.post_attention_layernorm.weight
        self.qkv_bias = attention.qkv_proj.bias
        self.qkv, self.o, self.gate_up, self.down = (
            projection_args(proj.weight)
            for proj in (attention.qkv_proj, attention.o_proj, mlp.gate_up_proj, mlp.down_proj)
        )
        # GGUF blocks are multiplied in one pass up to this many rows (kernels/quant_linear.py).
        self.max_tokens = GEMV_MAX_ROWS if self.qkv[1] else None

    def __call__(
        self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The layer's (hidden, residual); None for a step of more tokens than it takes fused."""
        if self.max_tokens is not None and hidden.shape[0] > self.max_tokens:
            return None
        context = get_forward_context()
        meta = context.attn_metadata
        if not self.prefills_fused and meta.num_decodes < meta.num_seqs:
            return None
        return torch.ops.raypage.llama_decoder_layer(
            hidden,
            residual,
            positions,
            self.input_norm,
            *self.qkv,
            self.qkv_bias,
            *self.o,
            self.post_norm,
            *self.gate_up,
            *self.down,
            self.rotary.cos,
            self.rotary.sin,
            context.kv_caches[self.layer_index],
            meta.slot_mapping,
            meta.block_table,
            meta.seq_lens,
            meta.query_start_loc_tensor,
            meta.num_decodes,
            cascade_blocks(meta) if self.prefills_fused else 0,
            self.num_heads,
            self.num_kv_heads,
            self.eps,
            self.scale,
        )


def _in_panels(weight: object, shards: int = 1) -> bool:
    return isinstance(weight, torch.Tensor) and weight.dim() == 4 and weight.shape[0] == shards


def fusable(
    layer: DecoderLayer, attention_backend: AttentionBackend, block_size: int, kv_cache_dtype: torch.dtype
) -> bool:
    """Whether every operator of `layer` runs on the fused call's kernels, over a cache of `kv_cache_dtype`."""
    attention, mlp = layer.self_attn, layer.mlp
    if type(layer) is not DecoderLayer or not (
        isinstance(attention, Attention) and attention.is_plain and type(mlp) is GatedMLP
    ):
        return False  # the C++ layer is Llama's: no q/k norms, windows, soft caps or other MLPs
    if mlp.activation is not None:
        return False
    if attention_backend is not cpu_paged_attention or attention.o_proj.tp_size != 1:
        return False
    if kv_cache_dtype != torch.bfloat16:
        return False
    projections = (attention.qkv_proj, attention.o_proj, mlp.gate_up_proj, mlp.down_proj)
    in_panels = (
        _in_panels(attention.qkv_proj.weight)
        and _in_panels(attention.o_proj.weight)
        and _in_panels(mlp.gate_up_proj.weight, shards=2)
        and _in_panels(mlp.down_proj.weight)
    )
    in_blocks = all(isinstance(proj.weight, BlockLinearWeight) for proj in projections)
    if any(proj.bias is not None for proj in projections[1:]):
        return False
    # Where AMX attends, the layer-by-layer forward takes it for the whole batch: the C++ call
    # would attend by other kernels, with other roundings.
    if amx_serves(_empty_cache(layer, block_size)):
        return False
    return in_blocks or (in_panels and prefills_fuse(layer, block_size))


def _empty_cache(layer: DecoderLayer, block_size: int) -> torch.Tensor:
    attention = layer.self_attn
    return torch.empty(2, attention.num_kv_heads, 0, block_size, attention.head_dim, dtype=torch.bfloat16)


def prefills_fuse(layer: DecoderLayer, block_size: int) -> bool:
    """Whether the tiled prefill kernel is built for the layer's shape here, so that the fused call
    takes prefill rows too."""
    attention = layer.self_attn
    query = torch.empty(0, attention.num_heads, attention.head_dim, dtype=torch.bfloat16)
    return tiled_serves(query, _empty_cache(layer, block_size))


def fuse_decoder_layers(
    model: nn.Module, attention_backend: AttentionBackend, block_size: int, kv_cache_dtype: torch.dtype
) -> int:
    """Give each decoder layer of `model` that can take it a fused call (over a cache of
    `kv_cache_dtype`); returns how many took one."""
    fused = 0
    for module in model.modules():
        if isinstance(module, DecoderLayer) and fusable(
            module, attention_backend, block_size, kv_cache_dtype
        ):
            module.fused = FusedDecoderLayer(module, prefills_fuse(module, block_size))
            fused += 1
    return fused
