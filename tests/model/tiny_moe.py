"""Tiny random-weight mixtures of experts (Qwen3-MoE, Qwen2-MoE, Mixtral) written by transformers
itself, so that tests read the checkpoint names it writes."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import (
    MixtralConfig,
    MixtralForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from engine.frontend.tokenizer import load_tokenizer
from engine.models.model_files import ModelSource, packaged_model_path


def write_tiny_moe(
    folder: Path,
    *,
    family: str = "qwen3_moe",
    num_experts: int = 4,
    top_k: int = 2,
    stacked: bool = False,
    seed: int = 0,
    **settings: object,
) -> Path:
    """A 2-layer model (hidden 64, experts of 32) with SmolLM2's tokenizer and random weights.

    transformers' save_pretrained writes each expert's projections as a tensor of its own, as Hub
    checkpoints do; `stacked` writes the experts as transformers 5 holds them in memory instead
    (`mlp.experts.gate_up_proj`, `mlp.experts.down_proj`). `settings` go to the config.
    """
    tokenizer = load_tokenizer(ModelSource(packaged_model_path(), "gguf"))
    common = dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        num_experts_per_tok=top_k,
        # No EOS: transformers then generates the full length, as the engine does with ignore_eos.
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,
    )
    torch.manual_seed(seed)
    if family == "mixtral":
        config = MixtralConfig(**common, intermediate_size=32, num_local_experts=num_experts, **settings)
        model = MixtralForCausalLM(config)
    elif family == "qwen2_moe":
        config = Qwen2MoeConfig(
            **common,
            intermediate_size=96,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            num_experts=num_experts,
            **settings,
        )
        model = Qwen2MoeForCausalLM(config)
    else:
        config = Qwen3MoeConfig(
            **common,
            head_dim=16,
            intermediate_size=96,  # the dense layers' (mlp_only_layers)
            moe_intermediate_size=32,
            num_experts=num_experts,
            **settings,
        )
        model = Qwen3MoeForCausalLM(config)
    # Random init leaves tiny weights (Qwen3-MoE's router all zeros: every expert tied) and
    # near-uniform logits; widen them so that routing and greedy picks are decisive.
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() >= 2:
                param.normal_(0.0, 0.3)
    model.save_pretrained(folder)
    if stacked:
        (folder / "model.safetensors").unlink()
        save_file(
            {name: tensor.contiguous() for name, tensor in model.state_dict().items()},
            folder / "model.safetensors",
        )
    tokenizer.save_pretrained(folder)
    return folder
