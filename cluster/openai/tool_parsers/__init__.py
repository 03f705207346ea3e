"""Tool-call extraction from model output text: one parser per format, looked up by name, each
giving OpenAI tool calls from the whole output or from its deltas as they are generated.

"json_array" is the server's own: the format its grammar forces for `tool_choice="required"`.
"""

from __future__ import annotations

from cluster.openai.tool_parsers.base import (
    ExtractedToolCalls,
    StreamDelta,
    ToolCall,
    ToolCallDelta,
    ToolCallStream,
    ToolParser,
    join_deltas,
)
from cluster.openai.tool_parsers.hermes import HermesToolParser
from cluster.openai.tool_parsers.json_array import JsonArrayToolParser
from cluster.openai.tool_parsers.llama3_json import Llama3JsonToolParser
from cluster.openai.tool_parsers.mistral import MistralToolParser
from cluster.openai.tool_parsers.pythonic import PythonicToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    parser.name: parser
    for parser in (
        HermesToolParser,
        Llama3JsonToolParser,
        MistralToolParser,
        PythonicToolParser,
        JsonArrayToolParser,
    )
}


def get_tool_parser(name: str) -> type[ToolParser]:
    """The parser class registered under `name`; ValueError naming the known ones otherwise."""
    try:
        return TOOL_PARSERS[name]
    except KeyError:
        known = ", ".join(sorted(TOOL_PARSERS))
        raise ValueError(f"unknown tool call parser {name!r}; known parsers: {known}") from None


__all__ = [
    "TOOL_PARSERS",
    "ExtractedToolCalls",
    "HermesToolParser",
    "JsonArrayToolParser",
    "Llama3JsonToolParser",
    "MistralToolParser",
    "PythonicToolParser",
    "StreamDelta",
    "ToolCall",
    "ToolCallDelta",
    "ToolCallStream",
    "ToolParser",
    "get_tool_parser",
    "join_deltas",
]
