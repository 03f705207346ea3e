"""What `tools` and `tool_choice` make of a chat request (cluster/openai/tool_calling.py), and tools in
chat templates that do not render them (engine/frontend/chat_tools.py)."""

from __future__ import annotations

import json

import jsonschema
import pytest

from cluster.openai.errors import OpenAIError
from cluster.openai.protocol import ChatCompletionRequest
from cluster.openai.tool_calling import NamedToolParser, check_tool_settings, plan_tools
from cluster.openai.tool_parsers import HermesToolParser, JsonArrayToolParser
from engine.frontend.tokenizer import render_chat_prompt
from engine.models.model_files import ModelSource, packaged_model_path
from engine.models.tokenizer_files import load_tokenizer
from tests.structured.checks import ADD_TOOL, TOOLS, WEATHER_TOOL

QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]


def request(**fields: object) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=QUESTION, **fields)


def test_a_named_function_forces_its_arguments_schema() -> None:
    plan = plan_tools(
        request(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "add"}}), None
    )
    assert plan.structured_outputs.json == ADD_TOOL["function"]["parameters"]
    assert isinstance(plan.parser, NamedToolParser)
    stream = plan.parser.stream()
    first, rest, end = stream.feed('{"a":'), stream.feed("1}"), stream.finish()
    assert (first.tool_calls[0].name, first.tool_calls[0].arguments) == ("add", '{"a":')
    assert first.tool_calls[0].id.startswith("call_") and rest.tool_calls[0].id is None
    assert rest.tool_calls[0].arguments == "1}" and not end.tool_calls
    assert plan.parser.extract('{"a":1,"b":2}').calls[0].arguments == '{"a":1,"b":2}'


def test_required_forces_an_array_of_calls_to_the_given_tools() -> None:
    plan = plan_tools(request(tools=TOOLS, tool_choice="required"), None)
    schema = plan.structured_outputs.json
    assert isinstance(plan.parser, JsonArrayToolParser) and "maxItems" not in schema
    jsonschema.validate([{"name": "add", "parameters": {"a": 1, "b": 2}}], schema)
    jsonschema.validate(
        [
            {"name": "get_weather", "parameters": {"city": "Oslo", "unit": "celsius"}},
            {"name": "add", "parameters": {"a": 0, "b": 0}},
        ],
        schema,
    )
    for wrong in (
        [],
        [{"name": "nope", "parameters": {}}],
        [{"name": "add", "parameters": {"a": "1", "b": 2}}],
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(wrong, schema)
    single = plan_tools(request(tools=TOOLS, tool_choice="required", parallel_tool_calls=False), None)
    assert single.structured_outputs.json["maxItems"] == 1


def test_auto_needs_the_servers_parser_and_none_leaves_the_text() -> None:
    with pytest.raises(OpenAIError) as caught:
        plan_tools(request(tools=TOOLS), None)  # auto is the default with tools
    assert caught.value.param == "tool_choice" and "--enable-auto-tool-choice" in caught.value.message
    auto = plan_tools(request(tools=TOOLS, tool_choice="auto"), "hermes")
    assert isinstance(auto.parser, HermesToolParser) and auto.structured_outputs is None
    none = plan_tools(request(tools=TOOLS, tool_choice="none"), "hermes")
    assert none.parser is None and none.structured_outputs is None
    assert [tool["function"]["name"] for tool in none.template_tools] == ["get_weather", "add"]
    assert plan_tools(request(), None).template_tools is None


@pytest.mark.parametrize(
    ("fields", "param", "text"),
    [
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
            "'nope'",
        ),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {"name": "f", "parameters": {"type": "object", "properties": 1}},
                    }
                ]
            },
            "tools",
            "tools[0].function.parameters",
        ),
    ],
)
def test_choices_that_cannot_be_served_are_400s_naming_the_field(fields: dict, param: str, text: str) -> None:
    with pytest.raises(OpenAIError) as caught:
        plan_tools(request(**fields), "hermes")
    assert caught.value.status == 400 and caught.value.param == param and text in caught.value.message


def test_server_settings_for_auto_tool_choice() -> None:
    check_tool_settings(False, None)
    check_tool_settings(True, "pythonic")
    with pytest.raises(ValueError, match="needs tool_call_parser"):
        check_tool_settings(True, None)
    with pytest.raises(ValueError, match="'json_array' is not one of hermes, llama3_json, mistral, pythonic"):
        check_tool_settings(True, "json_array")


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    return load_tokenizer(ModelSource(packaged_model_path(), "gguf"))


def test_a_template_that_ignores_tools_gets_them_as_text(smollm2_tokenizer) -> None:
    conversation = [
        *QUESTION,
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
            ],
        },
        {"role": "tool", "content": "22 degrees"},
    ]
    plain = render_chat_prompt(smollm2_tokenizer, conversation)["prompt"]
    with_tools = render_chat_prompt(smollm2_tokenizer, conversation, tools=[WEATHER_TOOL])["prompt"]
    assert "get_weather" not in plain  # SmolLM2's template renders neither the tools nor the call
    assert json.dumps(WEATHER_TOOL) in with_tools and "<tools>" in with_tools
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in with_tools
    assert "<|im_start|>tool\n22 degrees<|im_end|>" in with_tools


def test_a_template_that_renders_tools_renders_them_itself(smollm2_tokenizer) -> None:
    template = (
        "{% if tools %}TOOLS:{% for tool in tools %}{{ tool.function.name }};{% endfor %}\n{% endif %}"
        "{% for message in messages %}{{ message.role }}: {{ message.content }}\n{% endfor %}"
    )
    prompt = render_chat_prompt(smollm2_tokenizer, QUESTION, chat_template=template, tools=TOOLS)["prompt"]
    assert prompt.startswith("TOOLS:get_weather;add;") and "<tools>" not in prompt
    assert "user: What is the weather in Paris?" in prompt
