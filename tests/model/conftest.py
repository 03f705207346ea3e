"""SmolLM2-135M-Instruct (the packaged GGUF) loaded by transformers, as the reference."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from engine import LLM
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


@pytest.fixture(scope="package")
def llm() -> Iterator[LLM]:
    """SmolLM2 on the engine (float32, 256 KV blocks), one for the modules that run it as it is: a
    load costs seconds on two cores. A module that needs other settings defines its own `llm`."""
    engine = LLM(dtype="float32", num_kv_blocks=256)
    yield engine
    engine.llm_engine.shutdown()
