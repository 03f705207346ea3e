"""Structured outputs and tool calling through a real `raypage api-server` on SmolLM2, with the
official openai client: every schema of tests/structured/schemas.py at temperature 1.0 and several
seeds on both endpoints, regex / choice / grammar, streaming, n = 3, forced and auto tool calls,
conversations with tool results, the bad inputs (each a 400 naming the field, the engine serving on),
and the grammar metrics."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from openai.types.chat import ChatCompletion

from tests.cluster.remote_server import RemoteServer
from tests.structured.checks import (
    TOOLS,
    WEATHER_QUESTION,
    assert_forced_tool_calls,
    assert_json_schema_reply,
    check_json,
    in_parallel,
    reply_calls,
)
from tests.structured.schemas import SCHEMAS

# A server of its own and about a hundred generations: CI runs it, `make test-fast` leaves it out.
pytestmark = pytest.mark.slow

MODEL = "smollm2"
SEEDS = (0, 1, 2)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RemoteServer]:
    folder: Path = tmp_path_factory.mktemp("structured")
    flags = [
        "--served-model-name",
        MODEL,
        "--dtype",
        "float32",
        "--max-num-seqs",
        "64",
        "--disable-access-log",
    ]
    server = RemoteServer(
        [*flags, "--enable-auto-tool-choice", "--tool-call-parser", "hermes"], folder / "server.log"
    )
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(server: RemoteServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_every_schema_holds_on_chat_at_temperature_one(client: openai.OpenAI) -> None:
    def chat(case, seed):
        return lambda: client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": case.prompt + " Answer in JSON."}],
            response_format={
                "type": "json_schema",
                "json_schema": {"name": case.name, "schema": case.schema},
            },
            temperature=1.0,
            seed=seed,
            max_completion_tokens=150,
        )

    calls = [chat(case, seed) for case in SCHEMAS for seed in SEEDS]
    # 64 at once, the server's --max-num-seqs: two batches of the 96 rather than three of 32.
    for index, response in enumerate(in_parallel(calls, workers=64)):
        choice = response.choices[0]
        check_json(choice.message.content, SCHEMAS[index // len(SEEDS)].schema, choice.finish_reason)


def test_every_schema_holds_on_completions(client: openai.OpenAI) -> None:
    def complete(case):
        return lambda: client.completions.create(
            model=MODEL,
            prompt=f"{case.prompt} The answer, in JSON:",
            extra_body={"structured_outputs": {"json": case.schema}},
            temperature=1.0,
            seed=3,
            max_tokens=150,
        )

    for case, response in zip(SCHEMAS, in_parallel([complete(case) for case in SCHEMAS]), strict=True):
        check_json(response.choices[0].text, case.schema, response.choices[0].finish_reason)


def test_n3_and_streams_hold_to_the_schema(client: openai.OpenAI) -> None:
    schema = SCHEMAS[2].schema

    def n3() -> ChatCompletion:
        return client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Weather in Paris as JSON."}],
            response_format={"type": "json_schema", "json_schema": {"name": "w", "schema": schema}},
            temperature=1.0,
            seed=4,
            n=3,
            max_completion_tokens=100,
        )

    def json_object_stream() -> tuple[str, str | None]:
        text, finish = "", None
        for chunk in client.completions.create(
            model=MODEL,
            prompt="JSON:",
            extra_body={"response_format": {"type": "json_object"}},
            max_tokens=60,
            temperature=0.0,
            stream=True,
        ):
            text += chunk.choices[0].text
            finish = chunk.choices[0].finish_reason or finish
        return text, finish

    # The three requests at once (the engine batches them); each is checked as it would be alone.
    response, _, (text, finish) = in_parallel(
        [n3, lambda: assert_json_schema_reply(client, MODEL, schema, stream=True), json_object_stream]
    )
    assert [choice.index for choice in response.choices] == [0, 1, 2]
    for choice in response.choices:
        check_json(choice.message.content, schema, choice.finish_reason)
    if finish == "stop":
        assert isinstance(json.loads(text), dict)
    assert text.startswith("{")


def test_regex_choice_and_grammar_on_both_endpoints(client: openai.OpenAI) -> None:
    constraints = {
        r"\d{3}-\d{4}": {"regex": r"\d{3}-\d{4}"},
        "(red|green|blue)": {"choice": ["red", "green", "blue"]},
        "(yes|no), because [a-z]{2,10}": {"grammar": 'root ::= ("yes" | "no") ", because " [a-z]{2,10}'},
    }

    def completion(constraint, seed):
        return lambda: client.completions.create(
            model=MODEL,
            prompt="Answer:",
            extra_body={"structured_outputs": constraint},
            temperature=1.0,
            seed=seed,
            max_tokens=40,
        ).choices[0]

    def chat(constraint, seed):
        return lambda: client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Answer briefly."}],
            extra_body={"structured_outputs": constraint},
            temperature=1.0,
            seed=seed,
            max_completion_tokens=40,
        ).choices[0]

    cases = [(pattern, constraint, seed) for pattern, constraint in constraints.items() for seed in SEEDS]
    # Both endpoints' requests at once, in one batch of the engine's.
    replies = in_parallel(
        [call(constraint, seed) for _, constraint, seed in cases for call in (completion, chat)]
    )
    completions, chats = replies[0::2], replies[1::2]
    for (pattern, _, _), whole, reply in zip(cases, completions, chats, strict=True):
        assert re.fullmatch(pattern, whole.text) and whole.finish_reason == "stop", whole
        assert re.fullmatch(pattern, reply.message.content) and reply.finish_reason == "stop", reply


def test_forced_tool_calls_follow_their_schemas(client: openai.OpenAI) -> None:
    assert_forced_tool_calls(client, MODEL, seeds=range(3))


def test_auto_tool_choice_and_a_conversation_with_tool_results(client: openai.OpenAI) -> None:
    def reply(messages: list[dict], tool_choice: str, **settings: object):
        return client.chat.completions.create(
            model=MODEL,
            messages=messages,
            tools=TOOLS,
            tool_choice=tool_choice,
            max_completion_tokens=60,
            **settings,
        ).choices[0]

    # A call of the model's and the tool's answer go back through the chat template.
    call = {"name": "get_weather", "arguments": '{"city":"Paris","unit":"celsius"}'}
    conversation = [
        *WEATHER_QUESTION,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "call_1", "type": "function", "function": call}],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "22 degrees and sunny"},
    ]
    # The three replies are independent: asked at once, so that the engine batches them.
    auto, text, forced = in_parallel(
        [
            lambda: reply(WEATHER_QUESTION, "auto", temperature=0.0),
            lambda: reply(conversation, "none", temperature=0.0),
            lambda: reply(conversation, "required", temperature=1.0, seed=1, parallel_tool_calls=False),
        ]
    )
    assert auto.finish_reason in ("stop", "length", "tool_calls") and (
        auto.message.content or auto.message.tool_calls
    )
    assert text.message.content and not text.message.tool_calls
    assert forced.finish_reason == "tool_calls" and reply_calls(forced.message)


BAD_REQUESTS = {
    "an invalid schema": (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "object", "properties": 5}},
            }
        },
        "response_format",
        "response_format.json_schema.schema",
    ),
    "a keyword that cannot be enforced": (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "array", "uniqueItems": True}},
            }
        },
        "response_format",
        "uniqueItems",
    ),
    "an invalid regex": (
        {"structured_outputs": {"regex": "[a-"}},
        "structured_outputs",
        "structured_outputs.regex",
    ),
    "an invalid grammar": (
        {"structured_outputs": {"grammar": "root ::= missing_rule"}},
        "structured_outputs",
        "structured_outputs.grammar",
    ),
    "two constraints": (
        {"structured_outputs": {"regex": "a", "choice": ["a"]}},
        "structured_outputs",
        "one kind of constraint",
    ),
    "two fields": (
        {"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}},
        "response_format",
        "cannot both be given",
    ),
    "a named tool not in tools": (
        {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
        "tool_choice",
        "'nope'",
    ),
    "a malformed parameters schema": (
        {
            "tools": [
                {
                    "type": "function",
                    "function": {"name": "f", "parameters": {"type": "object", "required": 3}},
                }
            ],
            "tool_choice": "required",
        },
        "tools",
        "tools[0].function.parameters",
    ),
    "tool_choice without tools": ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    "a forced tool and a response format": (
        {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
        "tool_choice",
        "use one of them",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_REQUESTS))
def test_bad_constraints_are_400s_naming_the_field(client: openai.OpenAI, case: str) -> None:
    body, param, text = BAD_REQUESTS[case]
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Hi"}],
            max_completion_tokens=5,
            extra_body=body,
        )
    assert caught.value.body["param"] == param and text in caught.value.body["message"], caught.value.body


def test_the_engine_serves_on_and_reports_grammar_metrics(
    server: RemoteServer, client: openai.OpenAI
) -> None:
    reply = client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, temperature=0.0)
    assert reply.choices[0].text
    assert server.metric("raypage:structured_output_requests_total") >= len(SCHEMAS) * len(SEEDS)
    assert server.metric("raypage:grammar_compiles_total") >= len(SCHEMAS)
    assert server.metric("raypage:grammar_cache_hits_total") > 0
    assert server.metric("raypage:grammar_compile_seconds_total") > 0
