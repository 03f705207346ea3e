"""SmolLM2's tokenizer (the packaged GGUF's, cached after the first load) for text-level unit tests."""

from __future__ import annotations

import functools

from tokenizers import Tokenizer

from engine.frontend.detokenizer import backend_tokenizer
from engine.frontend.tokenizer import load_tokenizer
from engine.models.model_files import ModelSource, packaged_model_path

IM_END = 2  # <|im_end|>, a special token of SmolLM2


@functools.cache
def smollm2_tokenizer() -> Tokenizer:
    return backend_tokenizer(load_tokenizer(ModelSource(packaged_model_path(), "gguf")))


def encode(tok: Tokenizer, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False).ids
