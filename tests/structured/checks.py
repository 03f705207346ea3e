"""Checks on structured outputs and tool calls over the OpenAI API, shared by both front doors'
tests: each output is validated independently of the grammar library (`jsonschema`, `re`)."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jsonschema
import openai

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather of a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
ADD_TOOL = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "The sum of two integers",
        "parameters": {
            "type": "object",
            "properties": {
                "a": {"type": "integer", "minimum": -99, "maximum": 99},
                "b": {"type": "integer", "minimum": -99, "maximum": 99},
            },
            "required": ["a", "b"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER_TOOL, ADD_TOOL]
PARAMETERS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
WEATHER_QUESTION = [{"role": "user", "content": "What is the weather in Paris? Then add 2 and 3."}]


def in_parallel(calls: list[Any], workers: int = 32) -> list[Any]:
    """Run the zero-argument callables at once (so that the engine batches them); their results."""
    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(lambda call: call(), calls))


def check_json(text: str, schema: dict[str, Any], finish_reason: str | None) -> None:
    assert finish_reason == "stop", (finish_reason, text)
    jsonschema.validate(json.loads(text), schema)


def check_tool_calls(calls: list[dict[str, str]], allowed: set[str], at_least: int = 1) -> None:
    """Each call names an allowed tool, with arguments that follow its schema."""
    assert len(calls) >= at_least, calls
    for call in calls:
        assert call["name"] in allowed, call
        jsonschema.validate(json.loads(call["arguments"]), PARAMETERS[call["name"]])


def reply_calls(message: Any) -> list[dict[str, str]]:
    """A whole reply's tool calls, as dicts; ids distinct and OpenAI-shaped."""
    ids = [call.id for call in message.tool_calls]
    assert len(set(ids)) == len(ids) and all(call_id.startswith("call_") for call_id in ids)
    assert all(call.type == "function" for call in message.tool_calls)
    return [{"name": call.function.name, "arguments": call.function.arguments} for call in message.tool_calls]


def streamed_calls(chunks: Any) -> tuple[list[dict[str, str]], str | None]:
    """A stream's tool calls rebuilt from OpenAI's deltas (each call's first piece with its id and
    name, then argument fragments), and its finish reason."""
    calls: dict[int, dict[str, str]] = {}
    finish = None
    for chunk in chunks:
        for choice in chunk.choices:
            for piece in choice.delta.tool_calls or []:
                if piece.index not in calls:
                    assert piece.id and piece.type == "function" and piece.function.name, piece
                    calls[piece.index] = {"name": piece.function.name, "arguments": ""}
                else:
                    assert piece.id is None and piece.function.name is None, piece
                calls[piece.index]["arguments"] += piece.function.arguments or ""
            finish = choice.finish_reason or finish
    assert sorted(calls) == list(range(len(calls)))
    return [calls[index] for index in sorted(calls)], finish


def assert_forced_tool_calls(client: openai.OpenAI, model: str, seeds: range = range(2)) -> None:
    """tool_choice "required" and a named function, whole and streamed: every reply is tool calls
    whose arguments follow their tool's schema, and finish_reason is "tool_calls". Without
    parallel_tool_calls one call at most: a small model left free repeats calls until max_tokens.
    The requests go at once (the engine batches them); each is checked as it would be alone."""
    cases = []
    for choice, allowed in (
        ("required", set(PARAMETERS)),
        ({"type": "function", "function": {"name": "add"}}, {"add"}),
    ):
        for seed in seeds:
            settings = {
                "model": model,
                "messages": WEATHER_QUESTION,
                "tools": TOOLS,
                "tool_choice": choice,
                "temperature": 1.0,
                "seed": seed,
                "max_completion_tokens": 120,
                "parallel_tool_calls": False,
            }
            cases.append((settings, allowed))

    def whole(settings: dict[str, Any]) -> Any:
        return lambda: client.chat.completions.create(**settings).choices[0]

    def streamed(settings: dict[str, Any]) -> Any:
        return lambda: streamed_calls(client.chat.completions.create(**settings, stream=True))

    replies = in_parallel([call(settings) for settings, _ in cases for call in (whole, streamed)])
    for index, (_, allowed) in enumerate(cases):
        reply, (calls, finish) = replies[2 * index], replies[2 * index + 1]
        assert reply.finish_reason == "tool_calls" and not reply.message.content, reply
        check_tool_calls(reply_calls(reply.message), allowed)
        assert finish == "tool_calls"
        check_tool_calls(calls, allowed)
        assert len(calls) == 1


def assert_json_schema_reply(client: openai.OpenAI, model: str, schema: dict[str, Any], stream: bool) -> None:
    """A chat reply under response_format json_schema follows the schema (streamed: once joined)."""
    settings = {
        "model": model,
        "messages": [{"role": "user", "content": "Describe the weather as JSON."}],
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "weather", "schema": schema, "strict": True},
        },
        "temperature": 1.0,
        "seed": 7,
        "max_completion_tokens": 100,
    }
    if not stream:
        choice = client.chat.completions.create(**settings).choices[0]
        check_json(choice.message.content, schema, choice.finish_reason)
        return
    text, finish = "", None
    for chunk in client.chat.completions.create(**settings, stream=True):
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
    check_json(text, schema, finish)
