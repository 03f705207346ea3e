"""SmolLM2-135M-Instruct (the packaged GGUF) loaded by transformers, as the reference."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from pathlib import Path

import gguf
import pytest
import torch
from gguf import GGUFReader  # the class itself, for while `_gguf_parsed_once` replaces gguf's name

from engine import LLM
from engine.models.model_files import packaged_model_path


@pytest.fixture(scope="session")
def smollm2_gguf():
    return packaged_model_path()


@functools.cache
def _packaged_gguf_reader(path: str, mode: str) -> GGUFReader:
    return GGUFReader(path, mode)


@contextlib.contextmanager
def _gguf_parsed_once(path: Path) -> Iterator[None]:
    """While transformers loads the packaged file: gguf-py's reader of it and its tensor name maps
    built once. transformers parses the file's metadata (a 49k-token vocabulary) anew for the
    config, the weights and the tokenizer, and builds a name map anew for each of the model's ~400
    modules, about 30 s of the load on two cores; what it computes from them is the same."""

    def reader(file: str | Path, mode: str = "r") -> GGUFReader:
        if Path(file) == path:
            return _packaged_gguf_reader(str(file), mode)
        return GGUFReader(file, mode)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf, "GGUFReader", reader)
        patch.setattr(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map))
        yield


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_gguf):
    """transformers' own GGUF loader (its dequantization and Q/K un-permutation), float32."""
    from transformers import AutoModelForCausalLM

    with _gguf_parsed_once(smollm2_gguf):
        return AutoModelForCausalLM.from_pretrained(
            smollm2_gguf.parent, gguf_file=smollm2_gguf.name, dtype=torch.float32
        ).eval()


@pytest.fixture(scope="session")
def hf_tokenizer(smollm2_gguf):
    from transformers import AutoTokenizer

    with _gguf_parsed_once(smollm2_gguf):
        return AutoTokenizer.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name)


@pytest.fixture(scope="package")
def llm() -> Iterator[LLM]:
    """SmolLM2 on the engine (float32, 256 KV blocks), one for the modules that run it as it is: a
    load costs seconds on two cores. A module that needs other settings defines its own `llm`."""
    engine = LLM(dtype="float32", num_kv_blocks=256)
    yield engine
    engine.llm_engine.shutdown()
