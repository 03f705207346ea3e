"""Reasoning extraction from model output text (`--reasoning-parser NAME`, vLLM's names): the text
between `<think>` and `</think>` becomes the reply's `reasoning`, the rest its `content`."""

from __future__ import annotations

from cluster.openai.reasoning_parsers.base import (
    ExtractedReasoning,
    ReasoningDelta,
    ReasoningParser,
    ReasoningStart,
    ReasoningStream,
)
from cluster.openai.reasoning_parsers.think import DeepSeekR1ReasoningParser, Qwen3ReasoningParser

REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    parser.name: parser for parser in (DeepSeekR1ReasoningParser, Qwen3ReasoningParser)
}


def get_reasoning_parser(name: str) -> type[ReasoningParser]:
    """The parser class registered under `name`; ValueError naming the known ones otherwise."""
    try:
        return REASONING_PARSERS[name]
    except KeyError:
        known = ", ".join(sorted(REASONING_PARSERS))
        raise ValueError(f"unknown reasoning parser {name!r}; known parsers: {known}") from None


__all__ = [
    "REASONING_PARSERS",
    "DeepSeekR1ReasoningParser",
    "ExtractedReasoning",
    "Qwen3ReasoningParser",
    "ReasoningDelta",
    "ReasoningParser",
    "ReasoningStart",
    "ReasoningStream",
    "get_reasoning_parser",
]
