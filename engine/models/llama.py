"""Llama-family checkpoints (Llama 2/3, SmolLM2, Mistral, Qwen2): the decoder of decoder.py as it is."""

from __future__ import annotations

from engine.models.decoder import CausalLM


class LlamaForCausalLM(CausalLM):
    """Llama's pre-norm decoder; Mistral adds a sliding window, Qwen2 biases on Q, K and V, both
    read from the config (engine/models/arch_config.py)."""
