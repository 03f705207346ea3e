"""Incremental detokenization: each new token adds its text without re-decoding the sequence."""

from __future__ import annotations

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream
from transformers import PreTrainedTokenizerBase


def backend_tokenizer(tokenizer: PreTrainedTokenizerBase) -> Tokenizer:
    backend = getattr(tokenizer, "backend_tokenizer", None) or getattr(tokenizer, "_tokenizer", None)
    if not isinstance(backend, Tokenizer):
        raise TypeError(
            f"{type(tokenizer).__name__} has no fast (Rust) tokenizer to decode incrementally with"
        )
    return backend


class IncrementalDetokenizer:
    """Text of one sequence, grown token by token in the context of its prompt.

    Bytes of a character split across tokens are held back until the character is complete.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool) -> None:
        self._tokenizer = tokenizer
        # The prompt is context only: spacing of the first generated word depends on what precedes it.
        self._stream = DecodeStream(ids=prompt_token_ids, skip_special_tokens=skip_special_tokens)
        self.text = ""

    def add_tokens(self, token_ids: list[int]) -> str:
        """Append tokens; returns the text they completed (possibly empty)."""
        delta = "".join(
            piece for token in token_ids if (piece := self._stream.step(self._tokenizer, token)) is not None
        )
        self.text += delta
        return delta
