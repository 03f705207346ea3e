"""Random-weight Llama-family checkpoints (safetensors, sharded or not) against transformers."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine import LLM, SamplingParams
from engine.models.loader import safetensors_files
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
    llm = LLM(
        str(folder),
        dtype="float32",
        num_kv_blocks=32,
        block_size=8,
        max_num_batched_tokens=16,
        max_num_seqs=4,
    )
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    for output, prompt in zip(outputs, PROMPTS, strict=True):
        assert output.outputs[0].token_ids == hf_greedy(hf, prompt, MAX_TOKENS)
