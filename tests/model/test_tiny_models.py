"""Random-weight Llama-family checkpoints (safetensors, sharded or not) against transformers."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine.models.loader import safetensors_files
from tests.model.engine_greedy import engine_greedy
from tests.model.hf_reference import hf_greedy
from tests.model.tiny_models import write_tiny_model

PROMPTS = [[5, 17, 300, 42], [1000, 2000, 3000], list(range(100, 160)), [7]]
MAX_TOKENS = 12


@pytest.mark.parametrize(
    "options",
    [
        pytest.param({"family": "llama"}, id="llama-gqa-untied"),
        pytest.param(
            {"family": "llama", "tie_word_embeddings": True, "num_kv_heads": 4}, id="llama-mha-tied"
        ),
        pytest.param({"family": "llama", "max_shard_size": "2MB"}, id="llama-sharded"),
        pytest.param({"family": "qwen2"}, id="qwen2-qkv-bias"),
    ],
)
def test_tiny_model_matches_transformers(tmp_path, options):
    folder = write_tiny_model(tmp_path / "model", **options)
    if "max_shard_size" in options:
        assert len(safetensors_files(folder)) > 1
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    # Chunked prefill over a small cache, so the paged paths all run.
    outputs = engine_greedy(folder, PROMPTS, MAX_TOKENS, num_kv_blocks=32, max_num_batched_tokens=16)
    for output, prompt in zip(outputs, PROMPTS, strict=True):
        assert output == hf_greedy(hf, prompt, MAX_TOKENS)
