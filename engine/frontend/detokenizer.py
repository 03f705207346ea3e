"""Incremental detokenization and stop strings (vLLM semantics).

Each step decodes only its new tokens (tokenizers' `DecodeStream`) and searches for stop strings
only in the text that could hold a match ending in them, so a step costs O(new text) however long
the sequence is.
"""

from __future__ import annotations

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream
from transformers import PreTrainedTokenizerBase

# Prompt tokens fed to the stream before generation: enough context for decoders whose output for a
# token depends on what precedes it (SentencePiece drops the leading space of the first token only).
_PROMPT_CONTEXT_TOKENS = 8


def backend_tokenizer(tokenizer: PreTrainedTokenizerBase) -> Tokenizer:
    """The Rust `tokenizers.Tokenizer` behind a Hugging Face fast tokenizer."""
    backend = getattr(tokenizer, "backend_tokenizer", None) or getattr(tokenizer, "_tokenizer", None)
    if not isinstance(backend, Tokenizer):
        raise TypeError(
            f"{type(tokenizer).__name__} has no fast (Rust) tokenizer to decode incrementally with"
        )
    return backend


class IncrementalDetokenizer:
    """Text of one sequence, grown token by token in the context of its prompt, cut at a stop string.

    Bytes of a character split across tokens are held back until the character is complete. With stop
    strings (and `include_stop_str_in_output=False`), the last `max(len(stop)) - 1` characters are
    held back too (vLLM's stop buffer: the longest that could be the start of a match still
    growing), so that streamed text is never taken back; `finish` releases them. Stop strings match in generated text only, never across the prompt, and not in the
    text of the first `min_tokens` tokens. When several match, the one completed first in the text
    wins (ties: the longer one, which starts earlier): this does not depend on how the tokens were
    grouped into `add_tokens` calls.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: list[int],
        skip_special_tokens: bool,
        stop: list[str] | None = None,
        include_stop_str_in_output: bool = False,
        *,
        min_tokens: int = 0,
    ) -> None:
        self._tokenizer = tokenizer
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        # One token at a time, not DecodeStream(ids=prompt): if the prompt ends inside a character,
        # its bytes stay pending and the generated token that completes it yields that character
        # alone, where DecodeStream(ids=...) would yield the whole prompt's text again.
        for token in prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:]:
            self._stream.step(tokenizer, token)
        self._stop = tuple(stop or ())
        self._include_stop = include_stop_str_in_output
        # An included stop string is shown anyway, so text before it needs no holding back.
        self._hold_back = (
            max(map(len, self._stop)) - 1 if self._stop and not include_stop_str_in_output else 0
        )
        self._min_tokens = min_tokens
        self._num_tokens = 0
        # A stop string must end after this offset: the text of the first min_tokens tokens.
        self._check_from = 0
        # All text decoded so far (cut at a stop string), the held-back tail included.
        self._output = ""
        self._num_released = 0
        self._finished = False
        # The stop string that ended the text, or None.
        self.stop_reason: str | None = None

    @property
    def text(self) -> str:
        """The text so far that is final: released by `add_tokens` / `finish`, never taken back."""
        return self._output[: self._num_released]

    @property
    def finished(self) -> bool:
        """True once a stop string matched or `finish` was called: no more text will come."""
        return self._finished

    def add_tokens(self, token_ids: list[int]) -> str:
        """Append one step's generated tokens; returns the text they made final (possibly empty).

        After a stop string matched, further tokens are ignored: the engine may have produced them
        before it learned of the stop.
        """
        if self._finished:
            return ""
        first_new = len(self._output)
        if self._num_tokens < self._min_tokens:
            head = token_ids[: self._min_tokens - self._num_tokens]
            self._decode(head)
            self._check_from = len(self._output)
            token_ids = token_ids[len(head) :]
        self._decode(token_ids)
        if self._stop:
            self._find_stop(max(first_new, self._check_from))
        return self._release()

    def add_tokens_until_stop(self, token_ids: list[int]) -> int:
        """`add_tokens`, one token at a time where stop strings are set, so that a stop string
        completed by a token leaves the tokens after it unread (a step with speculative drafts
        returns several); how many tokens were read."""
        if not self._stop or len(token_ids) <= 1:
            self.add_tokens(token_ids)
            return len(token_ids)
        for count, token in enumerate(token_ids, start=1):
            self.add_tokens([token])
            if self._finished:
                return count
        return len(token_ids)

    def finish(self) -> str:
        """The sequence ended (without a stop string): release the held-back text and return it."""
        self._finished = True
        return self._release()

    def _decode(self, token_ids: list[int]) -> None:
        if not token_ids:
            return
        self._num_tokens += len(token_ids)
        piece = self._stream.step(self._tokenizer, token_ids)
        if piece is not None:
            self._output += piece

    def _find_stop(self, first_new: int) -> None:
        """Cut the text at the first stop string that ends at or after offset `first_new`.

        Earlier steps found no match ending before `first_new`, so only the last `len(stop) - 1`
        older characters plus the new ones need searching.
        """
        if first_new >= len(self._output):
            return
        best: tuple[int, int, str] | None = None
        for stop in self._stop:
            # Clamped: a negative start would make find count from the end of the string.
            start = self._output.find(stop, max(0, first_new - len(stop) + 1))
            if start != -1 and (best is None or (start + len(stop), start) < best[:2]):
                best = (start + len(stop), start, stop)
        if best is None:
            return
        end, start, self.stop_reason = best
        # The cut never reaches into released text: the match ends in new text and the hold-back
        # kept its possible start unreleased.
        self._output = self._output[: end if self._include_stop else start]
        self._finished = True

    def _release(self) -> str:
        end = len(self._output) if self._finished else len(self._output) - self._hold_back
        if end <= self._num_released:
            return ""
        delta = self._output[self._num_released : end]
        self._num_released = end
        return delta
