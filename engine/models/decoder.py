"""The decoder-only transformer every supported family is built from, for paged attention.

A family module (llama.py, qwen3.py, gemma.py, phi3.py, the mixtures of experts) subclasses the
pieces that differ: the attention (q/k norms, a scale, soft-capping), the MLP (activation, experts),
the layer (where its norms sit), and the checkpoint's tensor names. Everything is built from
`parallel/` layers, so the same code runs sharded under tensor parallelism: no model file computes a
rank, and pipeline stages hold only their layers (parallel/pipeline.py says which). The forward pass
takes a flat batch, `forward(input_ids, positions)`; the batch layout reaches attention through the
forward context.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.arch_config import ArchConfig
from engine.models.layers import PagedAttention, RMSNorm, RotaryEmbedding
from parallel.layers import (
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from parallel.pipeline import IntermediateTensors, stage_layers
from parallel.state import get_parallel_state

# Checkpoint projections that live inside one fused parameter: (fused, original, shard id).
STACKED_PARAMS: tuple[tuple[str, str, Any], ...] = (
    ("qkv_proj", "q_proj", "q"),
    ("qkv_proj", "k_proj", "k"),
    ("qkv_proj", "v_proj", "v"),
    ("gate_up_proj", "gate_proj", 0),
    ("gate_up_proj", "up_proj", 1),
)

# The gated MLP's activation of the gate, by the configs' `hidden_act` names (transformers' ACT2FN).
_GATE_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
}


class Attention(nn.Module):
    """Self-attention block: fused QKV projection, optional per-head q/k norms, rotary embedding,
    paged attention (with the layer's sliding window and soft cap), output projection."""

    def __init__(
        self,
        config: ArchConfig,
        layer_index: int,
        rotary_emb: RotaryEmbedding,
        dtype: torch.dtype,
        *,
        qk_norm: type[RMSNorm] | None = None,
        scale: float | None = None,
    ) -> None:
        super().__init__()
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, config.head_dim, config.num_heads, config.num_kv_heads, config.qkv_bias, dtype
        )
        self.o_proj = RowParallelLinear(
            config.num_heads * config.head_dim, config.hidden_size, config.o_bias, dtype
        )
        self.rotary_emb = rotary_emb
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.head_dim = config.head_dim
        self.q_norm = self.k_norm = None
        if qk_norm is not None:
            self.q_norm = qk_norm(config.head_dim, config.rms_norm_eps, dtype)
            self.k_norm = qk_norm(config.head_dim, config.rms_norm_eps, dtype)
        self.attn = PagedAttention(
            layer_index,
            self.num_heads,
            self.num_kv_heads,
            config.head_dim,
            scale=scale,
            sliding_window=config.layer_window(layer_index),
            logits_soft_cap=config.attn_logit_softcapping,
        )

    @property
    def is_plain(self) -> bool:
        """Whether this is Llama's attention: no q/k norm, the default scale, no window, no cap."""
        attn = self.attn
        return (
            self.q_norm is None
            and attn.scale == self.head_dim**-0.5
            and attn.sliding_window is None
            and attn.logits_soft_cap is None
        )

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv_proj(hidden)
        q_size, kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = q.reshape(-1, self.num_heads, self.head_dim)
        k = k.reshape(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v))


class GatedMLP(nn.Module):
    """Gated feed-forward block: down(act(gate(x)) * up(x)), SiLU by default (GeGLU for Gemma)."""

    def __init__(self, config: ArchConfig, dtype: torch.dtype, intermediate_size: int | None = None) -> None:
        super().__init__()
        size = intermediate_size or config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(
            config.hidden_size, [size, size], config.mlp_bias, dtype
        )
        self.down_proj = RowParallelLinear(size, config.hidden_size, config.mlp_bias, dtype)
        self.activation = None
        if config.hidden_act != "silu":
            if config.hidden_act not in _GATE_ACTIVATIONS:
                raise ValueError(
                    f"{config.architecture}: hidden_act {config.hidden_act!r} is not supported; "
                    f"supported: silu, {', '.join(_GATE_ACTIVATIONS)}"
                )
            self.activation = _GATE_ACTIVATIONS[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.activation is None:
            return self.down_proj(self.gate_up_proj.silu_and_mul(x))
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(self.activation(gate) * up)


class DecoderLayer(nn.Module):
    """Pre-norm transformer block (Llama's); the residual stream is carried alongside the hidden
    states so that each norm adds it in the same pass. Families override the builders."""

    norm_class: ClassVar[type[RMSNorm]] = RMSNorm

    def __init__(
        self, config: ArchConfig, layer_index: int, rotary_emb: RotaryEmbedding, dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.self_attn = self.build_attention(config, layer_index, rotary_emb, dtype)
        self.mlp = self.build_mlp(config, layer_index, dtype)
        self.input_layernorm = self.norm_class(config.hidden_size, config.rms_norm_eps, dtype)
        self.post_attention_layernorm = self.norm_class(config.hidden_size, config.rms_norm_eps, dtype)
        # The same layer as one C++ call, where engine/models/fused_layers.py finds that it can be
        # (it answers None for a step it does not take: this forward runs then).
        self.fused: Callable[..., tuple[torch.Tensor, torch.Tensor] | None] | None = None

    def build_attention(
        self, config: ArchConfig, layer_index: int, rotary_emb: RotaryEmbedding, dtype: torch.dtype
    ) -> nn.Module:
        return Attention(config, layer_index, rotary_emb, dtype)

    def build_mlp(self, config: ArchConfig, layer_index: int, dtype: torch.dtype) -> nn.Module:
        return GatedMLP(config, dtype)

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.fused is not None:
            fused = self.fused(positions, hidden, residual)
            if fused is not None:
                return fused
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class DecoderModel(nn.Module):
    """Embedding, decoder layers and final norm — of this pipeline stage only.

    Layers outside the stage are placeholders, so parameter names keep their global layer index.
    """

    def __init__(
        self,
        config: ArchConfig,
        dtype: torch.dtype,
        pipeline_partition: list[int] | None,
        layer_class: type[DecoderLayer],
        embed_scale: float | None = None,
    ) -> None:
        super().__init__()
        state = get_parallel_state()
        self.is_first_stage, self.is_last_stage = state.is_first_stage, state.is_last_stage
        self.start_layer, self.end_layer = stage_layers(config.num_layers, pipeline_partition)
        self.embed_tokens = (
            VocabParallelEmbedding(config.vocab_size, config.hidden_size, dtype)
            if self.is_first_stage
            else None
        )
        self.embed_scale = embed_scale
        # One cos/sin table for all layers with the same RoPE: at long contexts it is large.
        tables: dict[str, RotaryEmbedding] = {}

        def rotary_of(layer_index: int) -> RotaryEmbedding:
            theta, scaling = config.layer_rope(layer_index)
            key = repr((theta, scaling))
            if key not in tables:
                tables[key] = RotaryEmbedding(
                    config.head_dim, config.max_context, theta, scaling, config.max_position_embeddings
                )
            return tables[key]

        self.layers = nn.ModuleList(
            layer_class(config, i, rotary_of(i), dtype)
            if self.start_layer <= i < self.end_layer
            else nn.Identity()
            for i in range(config.num_layers)
        )
        norm_class = layer_class.norm_class
        self.norm = norm_class(config.hidden_size, config.rms_norm_eps, dtype) if self.is_last_stage else None
        # This stage's layers as a plain tuple (not registered twice): slicing the ModuleList at
        # every step would build a new ModuleList per forward pass.
        self.stage_layers = tuple(self.layers[self.start_layer : self.end_layer])

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        intermediate: IntermediateTensors | None = None,
    ) -> torch.Tensor | IntermediateTensors:
        if self.is_first_stage:
            hidden, residual = self.embed_tokens(input_ids), None
            if self.embed_scale is not None:
                # Gemma scales by sqrt(hidden_size) rounded to the activations' type, as transformers does.
                hidden = hidden * torch.tensor(self.embed_scale, dtype=hidden.dtype)
        else:
            hidden, residual = intermediate.hidden_states, intermediate.residual
        for layer in self.stage_layers:
            hidden, residual = layer(positions, hidden, residual)
        if not self.is_last_stage:
            return IntermediateTensors(hidden, residual)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class CausalLM(nn.Module):
    """Causal language model: hidden states (or, before the last stage, intermediate tensors) from
    `forward`, logits from `compute_logits` on the last stage.

    A family sets `layer_class`, maybe `embed_scaled`, and overrides `checkpoint_tensors` or
    `param_target` where its checkpoint names differ from Llama's.
    """

    layer_class: ClassVar[type[DecoderLayer]] = DecoderLayer
    embed_scaled: ClassVar[bool] = False
    stacked_params: ClassVar[tuple[tuple[str, str, Any], ...]] = STACKED_PARAMS

    def __init__(
        self, config: ArchConfig, dtype: torch.dtype, pipeline_partition: list[int] | None = None
    ) -> None:
        super().__init__()
        self.config = config
        embed_scale = config.hidden_size**0.5 if self.embed_scaled else None
        self.model = DecoderModel(config, dtype, pipeline_partition, self.layer_class, embed_scale)
        self.lm_head = None
        if self.model.is_last_stage:
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, dtype)
            if config.tie_word_embeddings and self.model.is_first_stage:
                self.lm_head.tie_to(self.model.embed_tokens)

    def forward(
        self, *inputs: torch.Tensor | IntermediateTensors | None
    ) -> torch.Tensor | IntermediateTensors:
        """This stage's layers: see DecoderModel.forward(input_ids, positions, intermediate)."""
        return self.model(*inputs)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits of the last stage's hidden states (gathered over the TP group), soft-capped where
        the family does (Gemma 2)."""
        logits = self.lm_head.compute_logits(hidden)
        cap = self.config.final_logit_softcapping
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def checkpoint_tensors(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """The checkpoint's tensors under the names `param_target` maps (a family whose checkpoint
        fuses what this model keeps apart splits them here)."""
        return iter(weights)

    def param_target(self, name: str) -> tuple[str, Any]:
        """The parameter a checkpoint tensor fills, and the shard of it (None: the whole parameter)."""
        for fused, original, shard_id in self.stacked_params:
            if f".{original}." in name:
                return name.replace(f".{original}.", f".{fused}."), shard_id
        return name, None

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load checkpoint tensors by Hugging Face name; every parameter of this stage must be filled,
        and a tensor that has no place in the model or the wrong shape is an error naming it.

        Tensors of other stages are skipped. A last stage with tied embeddings but no embedding of
        its own (pipeline parallel) fills its LM head from the embedding tensor.
        """
        params = dict(self.named_parameters())
        tied = self.config.tie_word_embeddings
        loaded: set[str] = set()
        for name, tensor in self.checkpoint_tensors(weights):
            if tied and name == "model.embed_tokens.weight" and "lm_head.weight" in params:
                _load(params, "lm_head.weight", None, tensor, name)
                loaded.add("lm_head.weight")
            if (
                "rotary_emb.inv_freq" in name
                or (tied and name == "lm_head.weight")
                or not self._in_stage(name)
            ):
                continue
            target, shard_id = self.param_target(name)
            _load(params, target, shard_id, tensor, name)
            loaded.add(target if shard_id is None else f"{target}:{shard_id}")
        missing = sorted(_expected_entries(params) - loaded)
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} tensors the model needs, e.g. {missing[:5]}")

    def _in_stage(self, name: str) -> bool:
        """Whether a checkpoint tensor belongs to this pipeline stage."""
        model = self.model
        if name.startswith("model.layers."):
            return model.start_layer <= int(name.split(".")[2]) < model.end_layer
        if name.startswith("model.embed_tokens."):
            return model.is_first_stage
        return model.is_last_stage  # the final norm and the LM head


def _load(
    params: dict[str, nn.Parameter], target: str, shard_id: Any, tensor: torch.Tensor, name: str
) -> None:
    """Fill (a shard of) one parameter from the checkpoint tensor `name` through its weight loader."""
    if target not in params:
        raise ValueError(f"checkpoint tensor {name!r} has no place in this model")
    param = params[target]
    try:
        if shard_id is None:
            param.weight_loader(param, tensor)
        else:
            param.weight_loader(param, tensor, shard_id)
    except ValueError as exc:
        raise ValueError(f"checkpoint tensor {name!r}: {exc}") from exc


def _expected_entries(params: dict[str, nn.Parameter]) -> set[str]:
    """Every parameter, and every shard of each fused one, that a checkpoint must provide: a
    parameter names its shards in `checkpoint_shards` (parallel/layers.py)."""
    expected: set[str] = set()
    for name, param in params.items():
        shards = getattr(param, "checkpoint_shards", ())
        expected.update([f"{name}:{shard}" for shard in shards] or [name])
    return expected
