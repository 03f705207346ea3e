"""Tiny random-weight checkpoints of each supported dense family, written by transformers itself
from the family's own config class, with SmolLM2's tokenizer (so text prompts work)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import transformers

from engine.frontend.tokenizer import load_tokenizer
from engine.models.model_files import ModelSource, packaged_model_path

SLIDING_WINDOW = 16

# family -> (config class, model class, settings beyond the shared ones)
FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {"pad_token_id": 0}),
    "gemma2": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        # Four layers: sliding and global alternate; both soft caps on. Untied: with random tied
        # embeddings the scaled input embedding dominates and every model repeats its last token.
        {
            "num_hidden_layers": 4,
            "tie_word_embeddings": False,
            "head_dim": 16,
            "query_pre_attn_scalar": 16,
            "sliding_window": SLIDING_WINDOW,
        },
    ),
    "gemma3": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        # Three layers, the third global (sliding_window_pattern 3), RoPE bases of their own.
        {
            "num_hidden_layers": 3,
            "tie_word_embeddings": False,
            "head_dim": 16,
            "query_pre_attn_scalar": 16,
            "sliding_window": SLIDING_WINDOW,
            "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
            "rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 2.0},
            },
        },
    ),
    "llama-yarn": (
        "LlamaConfig",
        "LlamaForCausalLM",
        {
            "max_position_embeddings": 256,
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        },
    ),
    "llama-dynamic": (
        "LlamaConfig",
        "LlamaForCausalLM",
        {
            "max_position_embeddings": 48,
            "rope_parameters": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
        },
    ),
}


def write_family_model(folder: Path, family: str, seed: int = 0, **overrides: Any) -> Path:
    """A small model of `family` (a key of FAMILIES) with decisive random weights, saved as
    safetensors with SmolLM2's tokenizer."""
    config_name, model_name, family_settings = FAMILIES[family]
    tokenizer = load_tokenizer(ModelSource(packaged_model_path(), "gguf"))
    settings: dict[str, Any] = dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        # No EOS: transformers then generates the full length, as the engine does with ignore_eos.
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,
    )
    settings.update(family_settings)
    settings.update(overrides)
    config = getattr(transformers, config_name)(**settings)
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config)
    # Random init leaves tiny weights and near-uniform logits; widen them so greedy picks are
    # decisive (norm weights too: Gemma's start at zero, meaning a scale of one).
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 2:
                param.normal_(0.0, 0.3)
            elif "norm" in name:
                param.normal_(0.0, 0.1)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
