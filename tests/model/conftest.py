"""SmolLM2-135M-Instruct (the packaged GGUF) loaded by transformers, as the reference."""

from __future__ import annotations

import pytest
import torch

from engine.models.model_files import packaged_model_path


@pytest.fixture(scope="session")
def smollm2_gguf():
    return packaged_model_path()


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_gguf):
    """transformers' own GGUF loader (its dequantization and Q/K un-permutation), float32."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        smollm2_gguf.parent, gguf_file=smollm2_gguf.name, dtype=torch.float32
    ).eval()


@pytest.fixture(scope="session")
def hf_tokenizer(smollm2_gguf):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name)
