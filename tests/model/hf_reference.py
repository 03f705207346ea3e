"""Hugging Face transformers as the independent reference: greedy generation, one prompt at a time
(no padding, so nothing but the weights and the math can differ)."""

from __future__ import annotations

import torch
from transformers import PreTrainedModel


def hf_greedy(model: PreTrainedModel, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Greedy continuation of `prompt_ids`, stopping at the model's EOS like the engine does."""
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt_ids], device=model.device),
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long, device=model.device),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=model.generation_config.eos_token_id or 0,
        )
    return out[0, len(prompt_ids) :].tolist()
