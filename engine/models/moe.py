"""Sparse mixture-of-experts blocks (Mixtral, Qwen2-MoE, Qwen3-MoE): a router and a fused layer of
experts, and for Qwen2-MoE a shared expert that every token goes through.

The router's logits pick each token's top-k experts (kernels/moe.py, `select_experts`), and
`FusedMoE` runs every token through its experts in one call (`fused_experts`: the C++ kernel on the
CPU, Triton on CUDA). The experts' weights are stacked, w13 [experts, 2 x intermediate, hidden]
(each expert's gate rows over its up rows) and w2 [experts, hidden, intermediate], and filled one
checkpoint tensor at a time by `FusedMoE.weight_loader`.

Tensor parallelism splits each expert like a gated MLP: gate and up by output rows, down by input
columns, and one all-reduce sums the partial outputs. With `enable_expert_parallel` the TP ranks
split the experts instead: each holds num_experts / tp_size whole experts (and loads no other), and
since the activations are the same on every rank of the group after the attention's all-reduce,
each computes its experts' share for every token, and the same one all-reduce adds the shares.

Checkpoints name the experts one by one (`mlp.experts.{e}.gate_proj.weight`, Hub checkpoints and
transformers' save_pretrained), or stacked as transformers 5 holds them in memory
(`mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj` [E, H, I]); `MoECausalLM` reads both.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from engine.models.arch_config import ArchConfig
from engine.models.decoder import CausalLM, GatedMLP
from kernels.linear import linear
from kernels.moe import fused_experts, select_experts
from parallel.comm import tensor_parallel_all_reduce
from parallel.layers import _divide, default_weight_loader
from parallel.state import get_parallel_state

# One expert's projection in a checkpoint: (the experts' module, expert, projection).
_EXPERT_TENSOR = re.compile(r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_SHARDS = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}


class Router(nn.Module):
    """The router's projection to one logit per expert (or the shared expert's one gate logit),
    whole on every rank."""

    def __init__(self, hidden_size: int, num_outputs: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_outputs, hidden_size, dtype=dtype), requires_grad=False)
        self.weight.weight_loader = _router_weight_loader  # type: ignore[attr-defined]

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return linear(hidden, self.weight)


def _router_weight_loader(param: nn.Parameter, loaded: torch.Tensor) -> None:
    # llama.cpp stores the shared expert's gate [1, hidden] as a vector of hidden values.
    if loaded.dim() == 1 and param.shape[0] == 1:
        loaded = loaded.unsqueeze(0)
    default_weight_loader(param, loaded)


class FusedMoE(nn.Module):
    """The experts of a sparse block as two stacked weights, split over the TP group by each
    expert's intermediate size, or by experts under expert parallelism (see the module docstring).

    A weight's checkpoint shards are (expert, "gate" | "up" | "down"); each rank lists only those
    of its own experts, and its loader skips the others'.
    """

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        renormalize: bool,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        state = get_parallel_state()
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        if state.enable_expert_parallel:
            self.num_local_experts = _divide(num_experts, state.tp_size, "number of experts")
            self.first_expert = state.tp_rank * self.num_local_experts
            self.shard_rank, self.intermediate_per_rank = 0, intermediate_size
        else:
            self.num_local_experts, self.first_expert = num_experts, 0
            self.shard_rank = state.tp_rank
            self.intermediate_per_rank = _divide(intermediate_size, state.tp_size, "expert intermediate size")
        local, inter = self.num_local_experts, self.intermediate_per_rank
        experts = range(self.first_expert, self.first_expert + local)
        self.w13_weight = self._parameter((local, 2 * inter, hidden_size), dtype, experts, ("gate", "up"))
        self.w2_weight = self._parameter((local, hidden_size, inter), dtype, experts, ("down",))

    def _parameter(
        self, shape: tuple[int, ...], dtype: torch.dtype, experts: range, projections: tuple[str, ...]
    ) -> nn.Parameter:
        param = nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)
        param.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        param.checkpoint_shards = tuple((e, p) for e in experts for p in projections)  # type: ignore[attr-defined]
        return param

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: tuple[int, str]) -> None:
        """Fill this rank's part of one expert's gate, up or down projection (checkpoint shapes
        [intermediate, hidden], or [hidden, intermediate] for down); another rank's expert is skipped."""
        expert, projection = shard_id
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"expert {expert} is outside the model's {self.num_experts} experts")
        local = expert - self.first_expert
        if not 0 <= local < self.num_local_experts:
            return  # held by another rank (expert parallelism)
        full, size = self.intermediate_size, self.intermediate_per_rank
        down = projection == "down"
        expected = (self.hidden_size, full) if down else (full, self.hidden_size)
        if tuple(loaded.shape) != expected:
            raise ValueError(
                f"expert {projection} projection has shape {tuple(loaded.shape)}, expected {expected}"
            )
        if down:
            param.data[local].copy_(loaded.narrow(1, self.shard_rank * size, size))
        else:
            offset = 0 if projection == "gate" else size
            param.data[local].narrow(0, offset, size).copy_(loaded.narrow(0, self.shard_rank * size, size))

    def forward(self, hidden: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        weights, ids = select_experts(router_logits, self.top_k, self.renormalize)
        out = fused_experts(hidden, weights, ids, self.w13_weight, self.w2_weight, self.first_expert)
        return tensor_parallel_all_reduce(out)


class SparseMoeBlock(nn.Module):
    """A decoder layer's MLP as a mixture of experts: `gate` (the router) and `experts`."""

    # Whether the family runs the config's shared expert (a config that has one is refused otherwise).
    has_shared_expert: bool = False

    def __init__(self, config: ArchConfig, dtype: torch.dtype) -> None:
        super().__init__()
        if config.hidden_act != "silu":
            raise ValueError(
                f"{config.architecture}: experts with hidden_act {config.hidden_act!r} are not supported"
            )
        if config.shared_expert_intermediate_size and not self.has_shared_expert:
            raise ValueError(f"{config.architecture}: shared experts are not supported for this family")
        self.gate = Router(config.hidden_size, config.num_experts, dtype)
        self.experts = FusedMoE(
            config.num_experts,
            config.num_experts_per_tok,
            config.hidden_size,
            config.moe_intermediate_size,
            config.norm_topk_prob,
            dtype,
        )

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.experts(hidden, self.gate(hidden))


class SharedExpertMoeBlock(SparseMoeBlock):
    """Routed experts plus a shared expert (a gated MLP split over the TP group like a dense one)
    whose output every token adds, weighted by sigmoid(shared_expert_gate · x) (Qwen2-MoE)."""

    has_shared_expert = True

    def __init__(self, config: ArchConfig, dtype: torch.dtype) -> None:
        super().__init__(config, dtype)
        self.shared_expert = GatedMLP(config, dtype, config.shared_expert_intermediate_size)
        self.shared_expert_gate = Router(config.hidden_size, 1, dtype)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        shared = torch.sigmoid(self.shared_expert_gate(hidden)) * self.shared_expert(hidden)
        return super().forward(hidden) + shared


class MoECausalLM(CausalLM):
    """A causal LM whose layers hold `SparseMoeBlock`s: it reads the experts one by one or stacked."""

    def checkpoint_tensors(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        return _split_stacked_experts(super().checkpoint_tensors(weights))

    def param_target(self, name: str) -> tuple[str, Any]:
        if match := _EXPERT_TENSOR.match(name):
            experts, expert, projection = match.groups()
            fused = "w2_weight" if projection == "down_proj" else "w13_weight"
            return f"{experts}.{fused}", (int(expert), _SHARDS[projection])
        return super().param_target(name)


# Experts stacked in one tensor: transformers 5's in-memory gate_up_proj [E, 2I, H] and down_proj
# [E, H, I]; llama.cpp's ffn_{gate,up,down}_exps, read as gate_proj / up_proj [E, I, H] and down_proj.
_STACKED_EXPERTS = re.compile(r"^(.*\.experts)\.(gate_up_proj|gate_proj|up_proj|down_proj)(?:\.weight)?$")


def _split_stacked_experts(
    weights: Iterable[tuple[str, torch.Tensor]],
) -> Iterator[tuple[str, torch.Tensor]]:
    """Stacked experts as the per-expert tensors Hub checkpoints hold."""
    for name, tensor in weights:
        match = _STACKED_EXPERTS.match(name)
        if match is None or tensor.dim() != 3:
            yield name, tensor
            continue
        experts, projection = match.groups()
        if projection == "gate_up_proj":
            parts = dict(zip(("gate_proj", "up_proj"), tensor.chunk(2, dim=1), strict=True))
        else:
            parts = {projection: tensor}
        for expert in range(tensor.shape[0]):
            for part, stacked in parts.items():
                yield f"{experts}.{expert}.{part}.weight", stacked[expert]


def build_moe_mlp(config: ArchConfig, layer_index: int, dtype: torch.dtype) -> nn.Module:
    """A Qwen-style layer's MLP: experts (with the shared one where the config has it) on the
    sparse layers, a dense gated MLP on the others."""
    if not is_sparse_layer(config, layer_index):
        return GatedMLP(config, dtype)
    if config.shared_expert_intermediate_size:
        return SharedExpertMoeBlock(config, dtype)
    return SparseMoeBlock(config, dtype)


def is_sparse_layer(config: ArchConfig, layer_index: int) -> bool:
    """Whether a layer's MLP is a mixture of experts: every decoder_sparse_step-th layer but those
    in mlp_only_layers (Qwen's settings; Mixtral's are all sparse)."""
    return (
        config.num_experts > 0
        and (layer_index + 1) % config.decoder_sparse_step == 0
        and layer_index not in config.mlp_only_layers
    )
