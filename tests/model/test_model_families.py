"""Every supported dense family (and the RoPE scalings) against transformers on the same tiny
random checkpoint: greedy outputs token-identical in float32, with chunked prefill over a small
paged cache, and prompts longer than the sliding windows."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.model.engine_greedy import engine_greedy
from tests.model.hf_reference import hf_greedy
from tests.model.tiny_families import SLIDING_WINDOW, write_family_model

# Short, one block, and three windows long.
PROMPTS = [[5, 17, 300, 42], [1000, 2000, 3000], list(range(100, 100 + 3 * SLIDING_WINDOW + 5))]
MAX_TOKENS = 12


@pytest.mark.parametrize("family", ["qwen3", "phi3", "gemma2", "gemma3"])
def test_family_matches_transformers(tmp_path, family):
    folder = write_family_model(tmp_path / family, family)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()
    outputs = engine_greedy(folder, PROMPTS, MAX_TOKENS, num_kv_blocks=48, max_num_batched_tokens=16)
    for output, prompt in zip(outputs, PROMPTS, strict=True):
        assert output == hf_greedy(hf, prompt, MAX_TOKENS)


@pytest.mark.parametrize("family", ["llama-yarn", "llama-dynamic"])
def test_rope_scaling_matches_transformers(tmp_path, family):
    """YaRN over its whole table; dynamic NTK generating past the original context, where each new
    position's base grows."""
    folder = write_family_model(tmp_path / family, family)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    prompts = [list(range(200, 240)), [9, 8, 7]]
    outputs = engine_greedy(folder, prompts, 24, num_kv_blocks=32)
    for output, prompt in zip(outputs, prompts, strict=True):
        assert output == hf_greedy(hf, prompt, 24)
