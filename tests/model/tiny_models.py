"""Tiny random-weight Llama-family checkpoints written to a folder as safetensors, the way a
Hugging Face checkpoint is laid out, so that tests exercise the real loader."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from engine.frontend.tokenizer import load_tokenizer
from engine.models.model_files import ModelSource, packaged_model_path


def write_tiny_model(
    folder: Path,
    *,
    family: str = "llama",
    tie_word_embeddings: bool = False,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    max_shard_size: str | None = None,
    seed: int = 0,
    max_position_embeddings: int = 512,
    hidden_size: int = 64,
    intermediate_size: int = 128,
    sliding_window: int = 16,
    vocab_size: int | None = None,
) -> Path:
    """A 2-layer model with SmolLM2's tokenizer (so text prompts work) and random weights
    (`sliding_window`: Mistral's, on every layer)."""
    tokenizer = load_tokenizer(ModelSource(packaged_model_path(), "gguf"))
    settings = dict(
        vocab_size=vocab_size or len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=2,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        # No EOS: transformers then generates the full length, as the engine does with ignore_eos.
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,
    )
    torch.manual_seed(seed)
    if family == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**settings))
    elif family == "mistral":
        model = MistralForCausalLM(MistralConfig(**settings, sliding_window=sliding_window))
    else:
        model = LlamaForCausalLM(LlamaConfig(**settings))
    # Random init leaves tiny weights and near-uniform logits; widen them so greedy picks are decisive.
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 2:
                param.normal_(0.0, 0.3)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(folder, **kwargs)
    tokenizer.save_pretrained(folder)
    return folder
