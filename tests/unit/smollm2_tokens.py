"""SmolLM2's tokenizer (the packaged GGUF's, cached after the first load) for text-level unit tests, and
a text cut into the pieces a stream delivers (parsers' streaming tests)."""

from __future__ import annotations

import functools
import random

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


def random_chunks(text: str, seed: int) -> list[str]:
    """The text in seeded random pieces of 0 to 7 characters."""
    rng = random.Random(seed)
    pieces, pos = [], 0
    while pos < len(text):
        size = rng.randint(0, 7)
        pieces.append(text[pos : pos + size])
        pos += size
    return pieces


def token_pieces(tok: Tokenizer, text: str) -> list[str]:
    """The text as a detokenizer streams it: the growth of the decoded prefix, token by token (a
    prefix ending inside a character's bytes waits for the next token)."""
    ids = encode(tok, text)
    pieces, previous = [], ""
    for i in range(len(ids)):
        current = tok.decode(ids[: i + 1])
        if current.endswith("\ufffd"):
            continue
        assert current.startswith(previous)
        pieces.append(current[len(previous) :])
        previous = current
    assert previous == text
    return pieces
