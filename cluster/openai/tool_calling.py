"""Tool calling on /v1/chat/completions: what `tools` and `tool_choice` make of a request.

- `none` (or no tools): the model answers in text; the tools still reach the chat template.
- a named function: the engine's grammar forces the function's arguments (a JSON object that
  follows its `parameters` schema); the whole output is that one call's arguments.
- `required`: the grammar forces a JSON array of one or more `{"name", "parameters"}` objects, each
  naming a given tool with arguments that follow its schema (one at most without
  `parallel_tool_calls`).
- `auto`: the model decides; the server's --tool-call-parser finds the calls in its text (a 400
  without --enable-auto-tool-choice, as in vLLM).

Each mode is a `ToolParser` (cluster/openai/tool_parsers/): the reply's calls come from its whole
extraction, a stream's tool-call deltas from its per-choice stream, so both agree.
"""

from __future__ import annotations

import dataclasses
from http import HTTPStatus
from typing import Any

from cluster.openai.errors import OpenAIError
from cluster.openai.protocol import ChatCompletionRequest
from cluster.openai.protocol_tools import ChatCompletionTool, NamedToolChoice
from cluster.openai.tool_parsers import (
    TOOL_PARSERS,
    JsonArrayToolParser,
    StreamDelta,
    ToolCallDelta,
    ToolCallStream,
    ToolParser,
    get_tool_parser,
)
from cluster.openai.tool_parsers.base import new_call_id
from engine.sampling_params import StructuredOutputsParams
from engine.structured.manager import check_structured_outputs

# The formats of models' own tool calls (--tool-call-parser); "json_array" is the server's own.
AUTO_TOOL_PARSERS = sorted(name for name in TOOL_PARSERS if name != JsonArrayToolParser.name)
# A tool without `parameters` takes any JSON object.
_ANY_OBJECT: dict[str, Any] = {"type": "object"}


def check_tool_settings(enable_auto_tool_choice: bool, tool_call_parser: str | None) -> None:
    """ValueError for server settings that cannot serve tool_choice "auto" (vLLM's rules)."""
    if tool_call_parser is not None and tool_call_parser not in AUTO_TOOL_PARSERS:
        raise ValueError(
            f"tool_call_parser {tool_call_parser!r} is not one of {', '.join(AUTO_TOOL_PARSERS)}"
        )
    if enable_auto_tool_choice and tool_call_parser is None:
        raise ValueError("enable_auto_tool_choice needs tool_call_parser (--tool-call-parser) to be set")


@dataclasses.dataclass
class ToolPlan:
    """How a chat request's tools shape its generation and its reply."""

    # The grammar that forces the calls (named and required), None where the model is free.
    structured_outputs: StructuredOutputsParams | None
    # Finds the calls in the output; None when the reply is text only.
    parser: ToolParser | None
    # The tools as the chat template takes them.
    template_tools: list[dict[str, Any]] | None


def plan_tools(request: ChatCompletionRequest, auto_tool_parser: str | None) -> ToolPlan:
    """The request's ToolPlan; an OpenAIError (400) naming the field for a choice that cannot be
    served: a named tool not in `tools`, `auto` without the server's parser, a tool whose
    `parameters` is no schema the grammar can enforce."""
    tools = request.tools or []
    choice = request.tool_choice
    if choice is None:
        choice = "auto" if tools else "none"
    if not tools:
        if choice != "none":
            raise OpenAIError(HTTPStatus.BAD_REQUEST, "tool_choice needs tools to choose from", "tool_choice")
        return ToolPlan(None, None, None)
    template_tools = [tool.model_dump(exclude_none=True) for tool in tools]
    for index, tool in enumerate(tools):
        _check_parameters(tool, index)
    if choice == "none":
        return ToolPlan(None, None, template_tools)
    if isinstance(choice, NamedToolChoice):
        named = next((tool for tool in tools if tool.function.name == choice.function.name), None)
        if named is None:
            raise OpenAIError(
                HTTPStatus.BAD_REQUEST,
                f"tool_choice names the function {choice.function.name!r}, which is not in tools",
                "tool_choice",
            )
        arguments = StructuredOutputsParams(json=named.function.parameters or _ANY_OBJECT)
        return ToolPlan(arguments, NamedToolParser(named.function.name), template_tools)
    if choice == "required":
        return ToolPlan(
            _required_calls(tools, request.parallel_tool_calls), JsonArrayToolParser(), template_tools
        )
    if auto_tool_parser is None:
        raise OpenAIError(
            HTTPStatus.BAD_REQUEST,
            '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set',
            "tool_choice",
        )
    return ToolPlan(None, get_tool_parser(auto_tool_parser)(), template_tools)


def _check_parameters(tool: ChatCompletionTool, index: int) -> None:
    field = f"tools[{index}].function.parameters"
    try:
        check_structured_outputs(StructuredOutputsParams(json=tool.function.parameters or _ANY_OBJECT))
    except ValueError as exc:
        message = str(exc).replace("structured_outputs.json", field, 1)
        raise OpenAIError(HTTPStatus.BAD_REQUEST, message, "tools") from None


def _required_calls(tools: list[ChatCompletionTool], parallel: bool) -> StructuredOutputsParams:
    """The grammar of `required`: an array of calls, each an object naming one tool with arguments
    that follow that tool's schema (vLLM's shape)."""
    call = {
        "anyOf": [
            {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "enum": [tool.function.name]},
                    "parameters": tool.function.parameters or _ANY_OBJECT,
                },
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for tool in tools
        ]
    }
    schema: dict[str, Any] = {"type": "array", "items": call, "minItems": 1}
    if not parallel:
        schema["maxItems"] = 1
    return StructuredOutputsParams(json=schema)


class NamedToolParser(ToolParser):
    """The reply of a named tool_choice: the whole output is the arguments of one call."""

    name = "named"

    def __init__(self, function_name: str) -> None:
        self.function_name = function_name

    def stream(self) -> ToolCallStream:
        return _NamedToolStream(self.function_name)


class _NamedToolStream(ToolCallStream):
    def __init__(self, function_name: str) -> None:
        self._function_name = function_name
        self._started = False

    def feed(self, delta_text: str) -> StreamDelta:
        if self._started:
            return StreamDelta(tool_calls=[ToolCallDelta(0, arguments=delta_text)] if delta_text else [])
        self._started = True
        return StreamDelta(tool_calls=[ToolCallDelta(0, new_call_id(), self._function_name, delta_text)])

    def finish(self) -> StreamDelta:
        return self.feed("") if not self._started else StreamDelta()
