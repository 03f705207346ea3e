"""Llama-family decoder (Llama 2/3, SmolLM2, Mistral, Qwen2) for paged attention.

Built from `parallel/` layers, so the same code runs sharded under tensor parallelism: this file
never computes a rank: pipeline stages hold only their layers (parallel/pipeline.py says which).
The forward pass takes a flat batch, `forward(input_ids, positions)`; the batch layout reaches
attention through the forward context.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
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
_STACKED_PARAMS = (
    ("qkv_proj", "q_proj", "q"),
    ("qkv_proj", "k_proj", "k"),
    ("qkv_proj", "v_proj", "v"),
    ("gate_up_proj", "gate_proj", 0),
    ("gate_up_proj", "up_proj", 1),
)


class LlamaAttention(nn.Module):
    """Self-attention block: fused QKV projection, rotary embedding, paged attention, output projection."""

    def __init__(
        self, config: ArchConfig, layer_index: int, rotary_emb: RotaryEmbedding, dtype: torch.dtype
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
        self.attn = PagedAttention(layer_index, self.num_heads, self.num_kv_heads, config.head_dim)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv_proj(hidden)
        q_size, kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q, k = self.rotary_emb(
            positions, q.view(-1, self.num_heads, self.head_dim), k.view(-1, self.num_kv_heads, self.head_dim)
        )
        return self.o_proj(self.attn(q, k, v))


class LlamaMLP(nn.Module):
    """Gated feed-forward block: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: ArchConfig, dtype: torch.dtype) -> None:
        super().__init__()
        size = config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(
            config.hidden_size, [size, size], config.mlp_bias, dtype
        )
        self.down_proj = RowParallelLinear(size, config.hidden_size, config.mlp_bias, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gate_up_proj.silu_and_mul(x))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm transformer block; the residual stream is carried alongside the hidden states."""

    def __init__(
        self, config: ArchConfig, layer_index: int, rotary_emb: RotaryEmbedding, dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_index, rotary_emb, dtype)
        self.mlp = LlamaMLP(config, dtype)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        # The same layer as one C++ call, where engine/models/fused_layers.py finds that it can be.
        self.fused: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.fused is not None:
            return self.fused(positions, hidden, residual)
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    """Embedding, decoder layers and final norm — of this pipeline stage only.

    Layers outside the stage are placeholders, so parameter names keep their global layer index.
    """

    def __init__(
        self, config: ArchConfig, dtype: torch.dtype, pipeline_partition: list[int] | None = None
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
        # One cos/sin table for all layers: at long contexts it is large.
        rotary_emb = RotaryEmbedding(
            config.head_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling
        )
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, rotary_emb, dtype)
            if self.start_layer <= i < self.end_layer
            else nn.Identity()
            for i in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype) if self.is_last_stage else None
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
        else:
            hidden, residual = intermediate.hidden_states, intermediate.residual
        for layer in self.stage_layers:
            hidden, residual = layer(positions, hidden, residual)
        if not self.is_last_stage:
            return IntermediateTensors(hidden, residual)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(nn.Module):
    """Causal language model: hidden states (or, before the last stage, intermediate tensors) from
    `forward`, logits from `compute_logits` on the last stage."""

    def __init__(
        self, config: ArchConfig, dtype: torch.dtype, pipeline_partition: list[int] | None = None
    ) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, dtype, pipeline_partition)
        self.lm_head = None
        if self.model.is_last_stage:
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, dtype)
            if config.tie_word_embeddings and self.model.is_first_stage:
                self.lm_head.tie_to(self.model.embed_tokens)

    def forward(
        self, *inputs: torch.Tensor | IntermediateTensors | None
    ) -> torch.Tensor | IntermediateTensors:
        """This stage's layers: see LlamaModel.forward(input_ids, positions, intermediate)."""
        return self.model(*inputs)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits of the last stage's hidden states (gathered over the TP group)."""
        return self.lm_head.compute_logits(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load checkpoint tensors by Hugging Face name; every parameter of this stage must be filled.

        Tensors of other stages are skipped. A last stage with tied embeddings but no embedding of
        its own (pipeline parallel) fills its LM head from the embedding tensor.
        """
        params = dict(self.named_parameters())
        tied = self.config.tie_word_embeddings
        loaded: set[str] = set()
        for name, tensor in weights:
            if tied and name == "model.embed_tokens.weight" and "lm_head.weight" in params:
                params["lm_head.weight"].weight_loader(params["lm_head.weight"], tensor)
                loaded.add("lm_head.weight")
            if (
                "rotary_emb.inv_freq" in name
                or (tied and name == "lm_head.weight")
                or not self._in_stage(name)
            ):
                continue
            for fused, original, shard_id in _STACKED_PARAMS:
                if f".{original}." in name:
                    target = name.replace(f".{original}.", f".{fused}.")
                    self._param(params, target, name).weight_loader(params[target], tensor, shard_id)
                    loaded.add(f"{target}:{shard_id}")
                    break
            else:
                self._param(params, name, name).weight_loader(params[name], tensor)
                loaded.add(name)
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

    @staticmethod
    def _param(params: dict[str, nn.Parameter], target: str, checkpoint_name: str) -> nn.Parameter:
        if target not in params:
            raise ValueError(f"checkpoint tensor {checkpoint_name!r} has no place in this model")
        return params[target]


def _expected_entries(params: dict[str, nn.Parameter]) -> set[str]:
    """Every parameter, and every shard of each fused one, that a checkpoint must provide."""
    expected: set[str] = set()
    for name in params:
        shards = [shard for fused, _, shard in _STACKED_PARAMS if f".{fused}." in name]
        expected.update([f"{name}:{shard}" for shard in shards] or [name])
    return expected
