"""GGUF files of the families llama.cpp defines, read by the engine and by transformers' own GGUF
reader (the independent reference): greedy outputs token-identical in float32."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.model.engine_greedy import engine_greedy
from tests.model.hf_reference import hf_greedy
from tests.model.test_model_families import PROMPTS
from tests.model.tiny_families import write_family_model
from tests.model.tiny_gguf import write_gguf
from tests.model.tiny_moe import write_tiny_moe

# Settings transformers' GGUF reader does not take from the file, set to the defaults it assumes:
# Qwen3's head_dim, Gemma's score scale (query_pre_attn_scalar = head_dim = 256) and Gemma 3's
# layer pattern (every sixth layer global) and RoPE bases.
_READER_DEFAULTS = {
    "qwen3": {"head_dim": 128},
    "phi3": {},
    # llama.cpp ties Gemma 2's output to its embedding (its GGUF has no `output` tensor).
    "gemma2": {"head_dim": 256, "query_pre_attn_scalar": 256, "tie_word_embeddings": True},
    "gemma3": {
        "head_dim": 256,
        "query_pre_attn_scalar": 256,
        "num_hidden_layers": 6,
        "layer_types": None,
        "rope_parameters": None,
    },
}


@pytest.mark.parametrize("family", list(_READER_DEFAULTS))
def test_gguf_family_matches_transformers(tmp_path, family):
    folder = write_family_model(tmp_path / family, family, **_READER_DEFAULTS[family])
    config = json.loads((folder / "config.json").read_text())
    # The prompts are token ids, so the file carries no tokenizer (transformers' reader would spend
    # seconds on SmolLM2's three times over); the engine reads the checkpoint folder's.
    path = write_gguf(folder, config, tmp_path / f"{family}.gguf", with_tokenizer=False)
    hf = AutoModelForCausalLM.from_pretrained(
        tmp_path, gguf_file=path.name, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    outputs = engine_greedy(
        path, PROMPTS, 10, num_kv_blocks=48, max_num_batched_tokens=16, tokenizer=str(folder)
    )
    for output, prompt in zip(outputs, PROMPTS, strict=True):
        assert output == hf_greedy(hf, prompt, 10)


@pytest.mark.parametrize(
    "options",
    [
        # llama.cpp renormalizes Qwen3-MoE's and Mixtral's top-k weights and not Qwen2-MoE's.
        pytest.param({"norm_topk_prob": True}, id="qwen3moe"),
        pytest.param({"family": "qwen2_moe", "norm_topk_prob": False}, id="qwen2moe"),
        pytest.param({"family": "mixtral"}, id="mixtral"),
    ],
)
def test_gguf_experts_match_transformers(tmp_path, options):
    """Mixtures of experts from GGUF against transformers on the checkpoint the file was written
    from (transformers' GGUF reader takes neither the experts' size nor Mixtral-as-llama)."""
    folder = write_tiny_moe(tmp_path / "model", **options)
    config = json.loads((folder / "config.json").read_text())
    path = write_gguf(folder, config, tmp_path / "model.gguf", with_tokenizer=False)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    outputs = engine_greedy(
        path, PROMPTS, 10, num_kv_blocks=48, max_num_batched_tokens=16, tokenizer=str(folder)
    )
    for output, prompt in zip(outputs, PROMPTS, strict=True):
        assert output == hf_greedy(hf, prompt, 10)
