"""The data types of reasoning extraction and the `<think>…</think>` parser every format builds on.

A reasoning model writes its reasoning first, between a start and an end tag, then its answer. A
parser splits a chat completion's output text into the two, either whole (`ReasoningParser.extract`,
for a non-streamed reply) or from text deltas as they are generated (`ReasoningParser.stream`, one
`ReasoningStream` per choice). Both paths run the same state machine, so they agree exactly. The
tags themselves are in neither part.

Unlike vLLM, which finds the tags by their token ids, the split works on the text: a tag may then
arrive split over several deltas (a model whose vocabulary has no single token for it), and the
stream holds back whatever may still turn out to be the start of one.
"""

from __future__ import annotations

import abc
import dataclasses
import enum
from collections.abc import Mapping
from typing import Any, ClassVar

from cluster.openai.tool_parsers.scanner import marker_prefix_len


class ReasoningStart(enum.Enum):
    """Where a request's output starts, as decided from the request before generating."""

    # The reasoning is open from the first token: the chat template wrote the start tag into the
    # prompt (DeepSeek-R1, QwQ, Qwen3.5), or the model writes it itself. A start tag at the very
    # beginning of the output is dropped.
    IMPLICIT = "implicit"
    # Reasoning only when the output opens with the start tag; otherwise all of it is content.
    TAGGED = "tagged"
    # No reasoning: the prompt already closed it (thinking disabled), all of the output is content.
    CONTENT = "content"


@dataclasses.dataclass
class ReasoningDelta:
    """What one step of a stream sends: a piece of the reasoning and a piece of the content."""

    reasoning: str = ""
    content: str = ""

    def __add__(self, other: ReasoningDelta) -> ReasoningDelta:
        return ReasoningDelta(self.reasoning + other.reasoning, self.content + other.content)


@dataclasses.dataclass
class ExtractedReasoning:
    """The two parts of a whole output; None where a part is empty (vLLM's `content or None`)."""

    reasoning: str | None
    content: str | None


class _Phase(enum.Enum):
    OPENING = "opening"  # nothing but whitespace so far: a start tag may still come
    REASONING = "reasoning"
    CONTENT = "content"


class ReasoningStream:
    """The streaming state of one choice: fed the output text in pieces of any size, it returns the
    reasoning and content that can be sent so far, holding back only text that may be part of a tag.

    Only the first end tag ends the reasoning; what follows it is content even if it holds more tags.
    """

    def __init__(self, start_tag: str, end_tag: str, start: ReasoningStart) -> None:
        self._start_tag = start_tag
        self._end_tag = end_tag
        self._implicit = start is ReasoningStart.IMPLICIT
        self._phase = _Phase.CONTENT if start is ReasoningStart.CONTENT else _Phase.OPENING
        self._held = ""

    def feed(self, delta_text: str) -> ReasoningDelta:
        """The next piece of the output text; returns what can be sent now."""
        self._held += delta_text
        return self._drain(final=False)

    def finish(self) -> ReasoningDelta:
        """The end of the output: returns what was held back (no tag after all)."""
        return self._drain(final=True)

    def _drain(self, final: bool) -> ReasoningDelta:
        if self._phase is _Phase.OPENING and not self._open(final):
            return ReasoningDelta()
        reasoning = ""
        if self._phase is _Phase.REASONING:
            end = self._held.find(self._end_tag)
            if end < 0:
                # Output cut short (max_tokens) before the end tag is all reasoning, as in vLLM.
                keep = 0 if final else marker_prefix_len(self._held, 0, len(self._held), self._end_tag)
                cut = len(self._held) - keep
                reasoning, self._held = self._held[:cut], self._held[cut:]
                return ReasoningDelta(reasoning=reasoning)
            reasoning = self._held[:end]
            self._held = self._held[end + len(self._end_tag) :]
            self._phase = _Phase.CONTENT
        content, self._held = self._held, ""
        return ReasoningDelta(reasoning, content)

    def _open(self, final: bool) -> bool:
        """Leave the opening once it is known whether the output starts with the start tag; False
        while the text so far is whitespace or a piece of the tag."""
        opening = self._held.lstrip()
        if opening.startswith(self._start_tag):
            # Whitespace before the tag is dropped with it (vLLM drops all text before the tag).
            self._held = opening[len(self._start_tag) :]
            self._phase = _Phase.REASONING
            return True
        if not final and self._start_tag.startswith(opening):
            return False
        self._phase = _Phase.REASONING if self._implicit else _Phase.CONTENT
        return True


class ReasoningParser(abc.ABC):
    """One reasoning format (a `--reasoning-parser NAME`), set up for one request: whole extraction,
    and a fresh streaming state per choice.

    Where the output starts (`ReasoningStart`) is decided once per request by `for_request`, from
    what the model was given: the rendered prompt, the request's chat_template_kwargs, and whether a
    grammar constrains the output.
    """

    name: ClassVar[str]
    start_tag: ClassVar[str] = "<think>"
    end_tag: ClassVar[str] = "</think>"

    def __init__(self, start: ReasoningStart = ReasoningStart.IMPLICIT) -> None:
        self.start = start

    @classmethod
    def for_request(
        cls, prompt_text: str, template_kwargs: Mapping[str, Any] | None, constrained: bool
    ) -> ReasoningParser:
        """The parser of one request: `prompt_text` as the chat template rendered it, and whether a
        grammar (structured outputs, a forced tool choice) constrains the output."""
        return cls(cls.reasoning_start(prompt_text, template_kwargs or {}, constrained))

    @classmethod
    def reasoning_start(
        cls, prompt_text: str, template_kwargs: Mapping[str, Any], constrained: bool
    ) -> ReasoningStart:
        """A prompt that ends with the end tag closed the reasoning itself (Qwen3's template with
        enable_thinking false ends in `<think>\\n\\n</think>\\n\\n`; vLLM's prompt_is_reasoning_end).

        The engine enforces a grammar from the first token (vLLM waits for the end of the reasoning):
        the output then holds reasoning only if the grammar let it open with the start tag, and a
        forced JSON answer is never mistaken for reasoning left open.
        """
        if prompt_text.rstrip().endswith(cls.end_tag):
            return ReasoningStart.CONTENT
        if constrained:
            return ReasoningStart.TAGGED
        return ReasoningStart.IMPLICIT

    def stream(self) -> ReasoningStream:
        """A fresh streaming state for one choice."""
        return ReasoningStream(self.start_tag, self.end_tag, self.start)

    def extract(self, text: str) -> ExtractedReasoning:
        """The reasoning and content of the whole output, by the same stream run over all of it."""
        stream = self.stream()
        parts = stream.feed(text) + stream.finish()
        return ExtractedReasoning(parts.reasoning or None, parts.content or None)
