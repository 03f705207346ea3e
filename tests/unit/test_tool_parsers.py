"""The tool-call parsers on recorded model outputs: whole extraction against the expected calls, and
streaming (one character, random chunks, or SmolLM2 token by token) against the whole extraction."""

from __future__ import annotations

import dataclasses
import json
import random
import re
from typing import Any

import pytest
from tokenizers import Tokenizer

from cluster.openai.tool_parsers import TOOL_PARSERS, get_tool_parser
from cluster.openai.tool_parsers.base import StreamDelta, ToolCallStream, ToolParser
from cluster.openai.tool_parsers.hermes import START as HERMES_START
from cluster.openai.tool_parsers.mistral import MARKER as MISTRAL_MARKER
from tests.unit.smollm2_tokens import random_chunks, token_pieces

CALL_ID = re.compile(r"call_[A-Za-z0-9]{24}")


@dataclasses.dataclass
class Case:
    """A recorded output and what the whole extraction must give for it."""

    id: str
    parser: str
    text: str
    calls: list[tuple[str, dict[str, Any]]]
    content: str | None = None


CASES = [
    Case(
        "hermes-content-then-call",
        "hermes",
        "I'll look up the weather in São Paulo for you.\n\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "São Paulo", "unit": "celsius"}}\n</tool_call>',
        [("get_weather", {"city": "São Paulo", "unit": "celsius"})],
        "I'll look up the weather in São Paulo for you.\n\n",
    ),
    Case(
        "hermes-two-calls",
        "hermes",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "東京"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": {"timezone": "Asia/Tokyo"}}\n</tool_call>',
        [("get_weather", {"city": "東京"}), ("get_time", {"timezone": "Asia/Tokyo"})],
    ),
    Case(
        "hermes-escapes-braces-arguments-first",
        "hermes",
        '<tool_call>\n{"arguments": {"text": "say \\"hi\\" to {everyone}", '
        '"nested": {"list": [1, {"a": "}"}]}},'
        ' "name": "send_message"}\n</tool_call>',
        [("send_message", {"text": 'say "hi" to {everyone}', "nested": {"list": [1, {"a": "}"}]}})],
    ),
    Case(
        "hermes-empty-arguments-unterminated",
        "hermes",
        'Checking now.\n<tool_call>\n{"name": "list_files", "arguments": {}}\n',
        [("list_files", {})],
        "Checking now.\n",
    ),
    Case(
        "hermes-no-arguments-key-and-text-between",
        "hermes",
        '<tool_call>{"name": "get_current_time"}</tool_call> and then <tool_call>'
        '{"name": "get_weather", "arguments": {"city": "Paris", "days": 3, "hourly": false}}</tool_call>\n',
        [("get_current_time", {}), ("get_weather", {"city": "Paris", "days": 3, "hourly": False})],
    ),
    Case(
        "llama3-one-call",
        "llama3_json",
        '{"name": "get_weather", "parameters": {"city": "San Francisco", "unit": "fahrenheit"}}',
        [("get_weather", {"city": "San Francisco", "unit": "fahrenheit"})],
    ),
    Case(
        "llama3-python-tag-two-calls",
        "llama3_json",
        '<|python_tag|>{"name": "search", "parameters": {"query": "São Paulo population"}}; '
        '{"name": "get_time", "parameters": {"city": "東京"}}',
        [("search", {"query": "São Paulo population"}), ("get_time", {"city": "東京"})],
    ),
    Case(
        "llama3-arguments-key-scalars-escapes",
        "llama3_json",
        '{"name": "echo", "arguments": '
        '{"text": "say \\"hi\\" {ok}", "n": -1.5e3, "flag": true, "none": null}}',
        [("echo", {"text": 'say "hi" {ok}', "n": -1500.0, "flag": True, "none": None})],
    ),
    Case(
        "llama3-whitespace-empty-arguments-three-calls",
        "llama3_json",
        '\n\n{"name": "list_tools", "parameters": {}} ;\n{"name": "add", "parameters": {"a": 1, "b": 2}};'
        '{"name": "noop", "parameters": {}}\n',
        [("list_tools", {}), ("add", {"a": 1, "b": 2}), ("noop", {})],
    ),
    Case(
        "mistral-v3-array",
        "mistral",
        '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}]',
        [("get_weather", {"city": "Paris", "unit": "celsius"})],
    ),
    Case(
        "mistral-v3-content-two-calls",
        "mistral",
        'Let me check both.[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "São Paulo"}}, '
        '{"name": "get_weather", "arguments": {"city": "東京"}}]',
        [("get_weather", {"city": "São Paulo"}), ("get_weather", {"city": "東京"})],
        "Let me check both.",
    ),
    Case(
        "mistral-v11-two-calls",
        "mistral",
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]add[ARGS]{"a": 1, "b": 2}',
        [("get_weather", {"city": "Paris"}), ("add", {"a": 1, "b": 2})],
    ),
    Case(
        "mistral-v11-content-escapes",
        "mistral",
        'Sure! Sending it now.\n[TOOL_CALLS]send_message[ARGS]{"text": "say \\"hi\\" {now} [ARGS]"}',
        [("send_message", {"text": 'say "hi" {now} [ARGS]'})],
        "Sure! Sending it now.\n",
    ),
    Case(
        "mistral-v11-args-marker-skipped-empty",
        "mistral",
        "[TOOL_CALLS]list_files{}",
        [("list_files", {})],
    ),
    Case(
        "pythonic-one-call",
        "pythonic",
        "[get_weather(city='San Francisco', metric=\"celsius\")]",
        [("get_weather", {"city": "San Francisco", "metric": "celsius"})],
    ),
    Case(
        "pythonic-literals",
        "pythonic",
        "[get_weather(city='São Paulo'), add(a=1, b=2.5, flags=[True, None], opts={'k': 'v'}, pair=(1, -2))]",
        [
            ("get_weather", {"city": "São Paulo"}),
            ("add", {"a": 1, "b": 2.5, "flags": [True, None], "opts": {"k": "v"}, "pair": [1, -2]}),
        ],
    ),
    Case(
        "pythonic-quotes-parens-empty",
        "pythonic",
        '[send_message(text=\'say "hi" to {everyone}\', note="it\\\'s ) fine"), list_files()]',
        [("send_message", {"text": 'say "hi" to {everyone}', "note": "it's ) fine"}), ("list_files", {})],
    ),
    Case(
        "pythonic-whitespace-unicode",
        "pythonic",
        "\n[search(query=\"東京 weather\"),\n search(query='a, b]'),]\n",
        [("search", {"query": "東京 weather"}), ("search", {"query": "a, b]"})],
    ),
    Case(
        "json-array-compact",
        "json_array",
        '[{"name":"get_weather","parameters":{"city":"Paris"}},{"name":"add","parameters":{"a":1,"b":2}}]',
        [("get_weather", {"city": "Paris"}), ("add", {"a": 1, "b": 2})],
    ),
    Case(
        "json-array-whitespace",
        "json_array",
        '[ {"name": "get_weather", "parameters": {"city": "東京"}} ]\n',
        [("get_weather", {"city": "東京"})],
    ),
    Case(
        "json-array-empty-parameters",
        "json_array",
        '[{"name":"noop","parameters":{}}]',
        [("noop", {})],
    ),
    Case(
        "json-array-escapes",
        "json_array",
        '[{"name":"echo","parameters":{"text":"a \\"b\\" {c} ]"}}]',
        [("echo", {"text": 'a "b" {c} ]'})],
    ),
]

# Outputs with no tool calls: all content, whole and streamed.
PLAIN = [
    ("hermes", "The weather in Paris is sunny. Tags like <b> or <tool_use> are not calls, nor is <tool_call"),
    ("hermes", "  \n"),
    ("llama3_json", "I can't call a tool for that, but the answer is 42."),
    ("llama3_json", "<|python_tag|>print('hello')"),
    ("mistral", "No tools needed. [TOOL] is not a marker, nor is [TOOL_CALL"),
    ("pythonic", "Here is a list: [1, 2, 3]"),
    ("pythonic", "[1, 2, 3] are numbers"),
    ("json_array", "Paris is the capital of France."),
]


@dataclasses.dataclass
class Malformed:
    """Broken output: the whole extraction gives it all as content. The stream falls back to
    content where it breaks: it sends `started` calls before that, and `stream_content` in all."""

    parser: str
    text: str
    started: int
    stream_content: str | None = None  # None: the whole text


MALFORMED = [
    Malformed("hermes", "Let me try.\n<tool_call>\nnot json\n</tool_call>", 0),
    Malformed("hermes", '<tool_call>{"arguments": {}, "name": 42}</tool_call>', 0),
    Malformed(
        "hermes",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris",}}\n</tool_call>',
        1,
        "}\n</tool_call>",
    ),
    Malformed(
        "hermes",
        'Working on it.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par',
        1,
        "Working on it.\n",
    ),
    Malformed("hermes", '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_', 1, "\n</tool_"),
    Malformed(
        "hermes",
        '<tool_call>{"name": "f", "arguments": {}}</tool_call>\n<tool_call>oops</tool_call>',
        1,
        "<tool_call>oops</tool_call>",
    ),
    Malformed("llama3_json", '{"city": "Paris", "temp": 22}', 0),
    Malformed(
        "llama3_json", '{"name": "f", "parameters": {"a": 1}} and then some text', 1, " and then some text"
    ),
    Malformed("mistral", "Sure.[TOOL_CALLS] I cannot do that.", 0),
    Malformed("mistral", '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}', 1, ""),
    Malformed("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": Paris}', 1, ""),
    Malformed("pythonic", "[get_weather(city=get_city())]", 0),
    Malformed("pythonic", "[get_weather('Paris')]", 0),
    Malformed("pythonic", "[get_weather(city=float('nan'))]", 0),
    Malformed("pythonic", "[get_weather(city='Paris')] Let me know!", 1, " Let me know!"),
    Malformed("json_array", "[]", 0),
    Malformed("json_array", '{"name":"f","parameters":{}}', 0),
    Malformed("json_array", '[{"name":"f","parameters":{"a":1}},]', 1, ",]"),
]


def parser_for(name: str) -> ToolParser:
    return get_tool_parser(name)()


def run_stream(parser: ToolParser, pieces: list[str]) -> tuple[list[StreamDelta], ToolCallStream]:
    stream = parser.stream()
    deltas = [stream.feed(piece) for piece in pieces]
    deltas.append(stream.finish())
    return deltas, stream


def rebuild(deltas: list[StreamDelta]) -> tuple[str, list[dict[str, str]]]:
    """The content and calls that the deltas add up to, checking the deltas' rules: calls in
    order, id and name on a call's first delta only."""
    content = ""
    calls: list[dict[str, str]] = []
    for delta in deltas:
        content += delta.content
        for piece in delta.tool_calls:
            if piece.index == len(calls):
                assert piece.id is not None and CALL_ID.fullmatch(piece.id)
                assert piece.name
                calls.append({"id": piece.id, "name": piece.name, "arguments": ""})
            else:
                assert piece.index == len(calls) - 1, "a call's pieces arrive before the next call's"
                assert piece.id is None and piece.name is None
            calls[piece.index]["arguments"] += piece.arguments
    return content, calls


def check_stream_matches_extraction(case: Case, pieces: list[str]) -> None:
    parser = parser_for(case.parser)
    whole = parser.extract(case.text)
    deltas, stream = run_stream(parser, pieces)
    content, calls = rebuild(deltas)
    assert not stream.fell_back
    assert (content or None) == whole.content
    assert [call["name"] for call in calls] == [call.name for call in whole.calls]
    assert [call["arguments"] for call in calls] == [call.arguments for call in whole.calls]
    assert len({call["id"] for call in calls}) == len(calls)


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.id)
def test_extract(case: Case) -> None:
    result = parser_for(case.parser).extract(case.text)
    assert [(call.name, json.loads(call.arguments)) for call in result.calls] == case.calls
    assert result.content == case.content
    assert all(CALL_ID.fullmatch(call.id) for call in result.calls)
    assert len({call.id for call in result.calls}) == len(result.calls)
    if case.parser != "pythonic":
        # The JSON formats' arguments are the raw text the model wrote.
        for call in result.calls:
            assert call.arguments == "{}" or call.arguments in case.text


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.id)
def test_stream_by_character(case: Case) -> None:
    check_stream_matches_extraction(case, list(case.text))


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.id)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_stream_by_random_chunks(case: Case, seed: int) -> None:
    check_stream_matches_extraction(case, random_chunks(case.text, seed))


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.id)
def test_stream_all_at_once(case: Case) -> None:
    check_stream_matches_extraction(case, [case.text])


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.id)
def test_stream_by_token(case: Case, tok: Tokenizer) -> None:
    check_stream_matches_extraction(case, token_pieces(tok, case.text))


@pytest.mark.parametrize(("parser_name", "text"), PLAIN)
def test_plain_content(parser_name: str, text: str, tok: Tokenizer) -> None:
    parser = parser_for(parser_name)
    whole = parser.extract(text)
    assert whole.calls == []
    assert whole.content == (text if text.strip() else None)
    for pieces in (list(text), random_chunks(text, 0), token_pieces(tok, text), [text]):
        content, calls = rebuild(run_stream(parser, pieces)[0])
        assert calls == []
        assert (content or None) == whole.content


@pytest.mark.parametrize(
    ("parser_name", "marker", "text"),
    [("hermes", HERMES_START, PLAIN[0][1]), ("mistral", MISTRAL_MARKER, PLAIN[4][1])],
)
def test_content_held_back_only_for_a_marker_prefix(parser_name: str, marker: str, text: str) -> None:
    stream = parser_for(parser_name).stream()
    sent = ""
    for n, ch in enumerate(text, start=1):
        sent += stream.feed(ch).content
        held = text[len(sent) : n]
        assert text.startswith(sent)
        assert held == "" or (marker.startswith(held) and len(held) < len(marker))
    assert sent + stream.finish().content == text


@pytest.mark.parametrize("parser_name", ["llama3_json", "pythonic", "json_array"])
def test_content_sent_once_it_cannot_be_calls(parser_name: str) -> None:
    stream = parser_for(parser_name).stream()
    assert stream.feed("Sure").content == "Sure"
    assert stream.feed(", here it is.").content == ", here it is."
    assert stream.finish() == StreamDelta()


@pytest.mark.parametrize("case", MALFORMED, ids=lambda case: f"{case.parser}-{case.text[:30]}")
def test_malformed(case: Malformed) -> None:
    parser = parser_for(case.parser)
    whole = parser.extract(case.text)
    assert whole.calls == []
    assert whole.content == case.text
    expected = case.text if case.stream_content is None else case.stream_content
    for pieces in (list(case.text), random_chunks(case.text, 1), [case.text]):
        deltas, stream = run_stream(parser, pieces)
        content, calls = rebuild(deltas)
        assert stream.fell_back
        assert len(calls) == case.started
        assert content == expected


# What the mutation test inserts: the formats' structural characters and markers.
MUTATIONS = [*"{}[]()\",:;'\\ \nx0", "<tool_call>", "</tool_call>", "[TOOL_CALLS]", "[ARGS]", "é"]


def test_mutated_outputs_stream_like_the_extraction() -> None:
    """Randomly damaged recorded outputs: nothing raises, how the text is cut into pieces changes
    nothing, and output that parses streams exactly what the whole extraction gives."""
    rng = random.Random(0)
    for _ in range(400):
        case = rng.choice(CASES)
        text = case.text
        for _ in range(rng.randint(1, 3)):
            at = rng.randrange(len(text) + 1)
            text = text[:at] + rng.choice(["", *MUTATIONS]) + text[at + rng.randint(0, 1) :]
        parser = parser_for(case.parser)
        whole = parser.extract(text)
        streamed = []
        for pieces in (list(text), random_chunks(text, rng.randrange(100)), [text]):
            deltas, stream = run_stream(parser, pieces)
            content, calls = rebuild(deltas)
            named = [(call["name"], call["arguments"]) for call in calls]
            streamed.append((content, named, stream.fell_back))
        assert streamed[0] == streamed[1] == streamed[2]
        content, named, fell_back = streamed[0]
        if fell_back:
            assert whole.calls == [] and whole.content == (text if text.strip() else None)
        else:
            assert (content or None) == whole.content
            assert named == [(call.name, call.arguments) for call in whole.calls]
            assert all(isinstance(json.loads(call.arguments), dict) for call in whole.calls)


def test_fallen_back_stream_passes_text_on() -> None:
    stream = parser_for("pythonic").stream()
    assert stream.feed("[not a call").content == "[not a call"
    assert stream.feed(" at all]").content == " at all]"
    assert stream.finish() == StreamDelta()


def test_unicode_arguments_are_not_escaped() -> None:
    text = "[get_weather(city='São Paulo', other=\"東京\")]"
    (call,) = parser_for("pythonic").extract(text).calls
    assert call.arguments == '{"city": "São Paulo", "other": "東京"}'


def test_arguments_keep_the_models_whitespace() -> None:
    text = '<tool_call>\n{"name": "f", "arguments": {\n  "a" :1,\n  "b": [ 2 ]\n}}\n</tool_call>'
    (call,) = parser_for("hermes").extract(text).calls
    assert call.arguments == '{\n  "a" :1,\n  "b": [ 2 ]\n}'


def test_ids_differ_between_extractions() -> None:
    text = CASES[0].text
    parser = parser_for("hermes")
    assert parser.extract(text).calls[0].id != parser.extract(text).calls[0].id


def test_registry() -> None:
    assert sorted(TOOL_PARSERS) == ["hermes", "json_array", "llama3_json", "mistral", "pythonic"]
    for name, parser in TOOL_PARSERS.items():
        assert get_tool_parser(name) is parser
        assert parser.name == name
    assert {name for name, parser in TOOL_PARSERS.items() if parser.needs_special_tokens} == {
        "hermes",
        "mistral",
    }
    with pytest.raises(ValueError, match=r"'nope'.*hermes, json_array, llama3_json, mistral, pythonic"):
        get_tool_parser("nope")
