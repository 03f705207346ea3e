"""The reasoning parsers on recorded DeepSeek-R1 and Qwen3 style outputs: whole extraction against the
expected split, and streaming (one character, random chunks, or SmolLM2 token by token, which splits
the tags over several deltas) against the whole extraction; then the chat reply that runs the tool
parser on the content only, and the server settings."""

from __future__ import annotations

import dataclasses
import json

import pytest
from tokenizers import Tokenizer

from cluster.openai.app import ServerSettings
from cluster.openai.chat_reply import ReplyDelta, ReplyParsers
from cluster.openai.reasoning_parsers import (
    REASONING_PARSERS,
    DeepSeekR1ReasoningParser,
    ExtractedReasoning,
    Qwen3ReasoningParser,
    ReasoningDelta,
    ReasoningParser,
    ReasoningStart,
    get_reasoning_parser,
)
from cluster.openai.tool_parsers import HermesToolParser
from tests.unit.smollm2_tokens import random_chunks, token_pieces

R1_PROMPT = "<｜begin▁of▁sentence｜><｜User｜>Which is greater, 9.11 or 9.8?<｜Assistant｜><think>\n"
QWEN3_PROMPT = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
QWEN3_NO_THINKING_PROMPT = QWEN3_PROMPT + "<think>\n\n</think>\n\n"


@dataclasses.dataclass
class Case:
    """A recorded output, the request it answered, and the split the whole extraction must give."""

    id: str
    parser: type[ReasoningParser]
    text: str
    reasoning: str | None
    content: str | None
    prompt: str = R1_PROMPT
    template_kwargs: dict | None = None
    constrained: bool = False

    def parser_instance(self) -> ReasoningParser:
        return self.parser.for_request(self.prompt, self.template_kwargs, self.constrained)


R1_REASONING = (
    "Okay, so I need to figure out whether 9.11 or 9.8 is greater. Let me line up the decimals: "
    "9.11 is 9.110 and 9.8 is 9.800. Comparing the tenths, 8 > 1, so 9.8 is larger.\n"
)
QWEN3_REASONING = (
    "\nOkay, the user is asking for the capital of France. That's Paris — 巴黎 in Chinese, and "
    "the HTML tag </thead> or a comparison like 1 < 2 is no end of thinking.\n"
)

CASES = [
    Case(
        "r1-start-tag-in-the-prompt",
        DeepSeekR1ReasoningParser,
        R1_REASONING + "</think>\n\n**9.8 is greater than 9.11.**",
        R1_REASONING,
        "\n\n**9.8 is greater than 9.11.**",
    ),
    Case(
        "r1-0528-writes-the-start-tag",
        DeepSeekR1ReasoningParser,
        "<think>\n" + R1_REASONING + "</think>\n\n9.8 is greater.",
        "\n" + R1_REASONING,
        "\n\n9.8 is greater.",
    ),
    Case(
        "r1-cut-short-by-max-tokens-is-all-reasoning",
        DeepSeekR1ReasoningParser,
        R1_REASONING + "Wait, let me double-check that by subtracting: 9.8 - 9.11 = 0.6",
        R1_REASONING + "Wait, let me double-check that by subtracting: 9.8 - 9.11 = 0.6",
        None,
    ),
    Case(
        "r1-cut-short-inside-the-end-tag",
        DeepSeekR1ReasoningParser,
        "Done thinking.\n</thi",
        "Done thinking.\n</thi",
        None,
    ),
    Case(
        "r1-ends-right-after-the-end-tag",
        DeepSeekR1ReasoningParser,
        R1_REASONING + "</think>",
        R1_REASONING,
        None,
    ),
    Case(
        "r1-only-the-first-end-tag-counts",
        DeepSeekR1ReasoningParser,
        "a</think>b</think>c",
        "a",
        "b</think>c",
    ),
    Case(
        "qwen3-writes-both-tags",
        Qwen3ReasoningParser,
        "<think>" + QWEN3_REASONING + "</think>\n\nThe capital of France is **Paris**.",
        QWEN3_REASONING,
        "\n\nThe capital of France is **Paris**.",
        prompt=QWEN3_PROMPT,
    ),
    Case(
        "qwen3-empty-reasoning",
        Qwen3ReasoningParser,
        "<think>\n\n</think>\n\nParis.",
        "\n\n",
        "\n\nParis.",
        prompt=QWEN3_PROMPT,
    ),
    Case(
        "qwen3-nothing-between-the-tags",
        Qwen3ReasoningParser,
        "<think></think>Paris.",
        None,
        "Paris.",
        prompt=QWEN3_PROMPT,
    ),
    Case(
        "qwen3-whitespace-before-the-start-tag-is-dropped",
        Qwen3ReasoningParser,
        "\n<think>hmm</think>Paris.",
        "hmm",
        "Paris.",
        prompt=QWEN3_PROMPT,
    ),
    Case(
        "qwen3-5-start-tag-in-the-prompt",
        Qwen3ReasoningParser,
        QWEN3_REASONING + "</think>\n\nParis.",
        QWEN3_REASONING,
        "\n\nParis.",
        prompt=QWEN3_PROMPT + "<think>\n",
    ),
    Case(
        "qwen3-the-template-closed-the-reasoning",
        Qwen3ReasoningParser,
        "The capital of France is Paris. A literal </think> here is content.",
        None,
        "The capital of France is Paris. A literal </think> here is content.",
        prompt=QWEN3_NO_THINKING_PROMPT,
    ),
    Case(
        "qwen3-enable-thinking-false",
        Qwen3ReasoningParser,
        "The capital of France is Paris.",
        None,
        "The capital of France is Paris.",
        prompt=QWEN3_PROMPT,
        template_kwargs={"enable_thinking": False},
    ),
    Case(
        "r1-ignores-enable-thinking",
        DeepSeekR1ReasoningParser,
        "Paris.",
        "Paris.",
        None,
        template_kwargs={"enable_thinking": False},
    ),
    Case(
        "constrained-json-is-content",
        DeepSeekR1ReasoningParser,
        '{"answer": 9.8}',
        None,
        '{"answer": 9.8}',
        constrained=True,
    ),
    Case(
        "constrained-output-that-opens-with-the-tag",
        Qwen3ReasoningParser,
        "<think>compare tenths</think>9.8",
        "compare tenths",
        "9.8",
        prompt=QWEN3_PROMPT,
        constrained=True,
    ),
    Case(
        "constrained-output-that-opens-with-another-tag",
        DeepSeekR1ReasoningParser,
        '<tool_call>{"name": "f"}</tool_call>',
        None,
        '<tool_call>{"name": "f"}</tool_call>',
        constrained=True,
    ),
    Case("empty-output", DeepSeekR1ReasoningParser, "", None, None),
]


def run_stream(parser: ReasoningParser, pieces: list[str]) -> list[ReasoningDelta]:
    stream = parser.stream()
    return [*(stream.feed(piece) for piece in pieces), stream.finish()]


def check_stream_matches_extraction(case: Case, pieces: list[str]) -> None:
    parser = case.parser_instance()
    deltas = run_stream(parser, pieces)
    streamed = ExtractedReasoning(
        "".join(delta.reasoning for delta in deltas) or None,
        "".join(delta.content for delta in deltas) or None,
    )
    assert streamed == parser.extract(case.text) == ExtractedReasoning(case.reasoning, case.content)
    # Reasoning ends before content begins: no delta goes back to reasoning after content.
    first_content = next((i for i, delta in enumerate(deltas) if delta.content), len(deltas))
    assert not any(delta.reasoning for delta in deltas[first_content + 1 :])


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.id)
def test_extract(case: Case) -> None:
    assert case.parser_instance().extract(case.text) == ExtractedReasoning(case.reasoning, case.content)


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.id)
def test_stream_by_token(case: Case, tok: Tokenizer) -> None:
    pieces = token_pieces(tok, case.text)
    if "<think>" in case.text:
        assert "<think>" not in pieces, "SmolLM2 splits the tag over several tokens"
    check_stream_matches_extraction(case, pieces)


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.id)
def test_stream_by_character_random_chunks_and_whole(case: Case) -> None:
    for pieces in (list(case.text), random_chunks(case.text, 0), random_chunks(case.text, 1), [case.text]):
        check_stream_matches_extraction(case, pieces)


def test_only_a_possible_tag_is_held_back() -> None:
    stream = DeepSeekR1ReasoningParser().stream()
    assert stream.feed("9.8 ") == ReasoningDelta(reasoning="9.8 ")
    assert stream.feed("is larger </th") == ReasoningDelta(reasoning="is larger ")
    assert stream.feed("ink>") == ReasoningDelta()
    assert stream.feed("\n\nDone") == ReasoningDelta(content="\n\nDone")
    opening = Qwen3ReasoningParser().stream()
    assert opening.feed(" \n<thi") == ReasoningDelta()  # maybe the start tag
    assert opening.feed("nk>x") == ReasoningDelta(reasoning="x")
    tagged = Qwen3ReasoningParser(ReasoningStart.TAGGED).stream()
    assert tagged.feed("<tool") == ReasoningDelta(content="<tool")


def test_reasoning_start_is_decided_from_the_request() -> None:
    assert DeepSeekR1ReasoningParser.for_request(R1_PROMPT, None, False).start is ReasoningStart.IMPLICIT
    assert Qwen3ReasoningParser.for_request(QWEN3_PROMPT, {}, False).start is ReasoningStart.IMPLICIT
    for parser in REASONING_PARSERS.values():
        assert parser.for_request(QWEN3_NO_THINKING_PROMPT, None, False).start is ReasoningStart.CONTENT
        assert parser.for_request(QWEN3_PROMPT, None, True).start is ReasoningStart.TAGGED
    thinking_off = {"enable_thinking": False}
    assert Qwen3ReasoningParser.for_request(QWEN3_PROMPT, thinking_off, True).start is ReasoningStart.CONTENT


# ---- the chat reply: tool calls in the content only ----

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TOOL_OUTPUT = (
    "The user wants the weather. I could emit <tool_call> now, but first I check the city.\n"
    "</think>\n\nLet me look that up.\n" + CALL
)


def replay(parsers: ReplyParsers, pieces: list[str]) -> list[ReplyDelta]:
    stream = parsers.stream()
    return [stream.feed(piece, finished=i == len(pieces) - 1) for i, piece in enumerate(pieces)]


def test_tool_calls_are_found_in_the_content_only(tok: Tokenizer) -> None:
    parsers = ReplyParsers(DeepSeekR1ReasoningParser(), HermesToolParser())
    message = parsers.message(TOOL_OUTPUT)
    assert message.reasoning == message.reasoning_content == TOOL_OUTPUT.split("</think>")[0]
    assert message.content == "\n\nLet me look that up.\n"
    [call] = message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Paris"})

    deltas = replay(parsers, token_pieces(tok, TOOL_OUTPUT))
    assert "".join(delta.reasoning for delta in deltas) == message.reasoning
    assert "".join(delta.content for delta in deltas) == message.content
    arguments = "".join(piece.arguments for delta in deltas for piece in delta.tool_calls)
    assert arguments == call.function.arguments
    assert [piece.name for delta in deltas for piece in delta.tool_calls if piece.name] == ["get_weather"]


def test_a_call_inside_the_reasoning_is_not_made() -> None:
    message = ReplyParsers(DeepSeekR1ReasoningParser(), HermesToolParser()).message(
        CALL + "</think>It's sunny."
    )
    assert message.tool_calls == [] and message.reasoning == CALL and message.content == "It's sunny."


def test_include_reasoning_false_drops_it_and_keeps_the_content() -> None:
    parsers = ReplyParsers(DeepSeekR1ReasoningParser(), include_reasoning=False)
    message = parsers.message("thinking</think>answer")
    assert (message.reasoning, message.content) == (None, "answer")
    assert "".join(delta.content for delta in replay(parsers, list("thinking</think>answer"))) == "answer"
    assert not any(delta.reasoning for delta in replay(parsers, list("thinking</think>answer")))


def test_reply_without_a_reasoning_parser_is_unchanged() -> None:
    message = ReplyParsers().message("<think>a</think>b")
    assert (message.content, message.reasoning) == ("<think>a</think>b", None)
    assert ReplyParsers().message("").content == ""  # as before: "" without a reasoning parser
    assert ReplyParsers(DeepSeekR1ReasoningParser()).message("a</think>").content is None  # vLLM's null


def test_delta_messages_carry_both_names_and_drop_absent_keys() -> None:
    delta = ReplyDelta(reasoning="hmm").message().model_dump()
    assert delta == {"reasoning": "hmm", "reasoning_content": "hmm"}
    assert ReplyDelta(content="Paris").message().model_dump() == {"content": "Paris"}


# ---- the server setting ----


def test_unknown_parser_names_the_known_ones() -> None:
    assert sorted(REASONING_PARSERS) == ["deepseek_r1", "qwen3"]
    assert get_reasoning_parser("qwen3") is Qwen3ReasoningParser
    with pytest.raises(
        ValueError, match="unknown reasoning parser 'deepseek-r1'; known parsers: deepseek_r1, qwen3"
    ):
        get_reasoning_parser("deepseek-r1")
    with pytest.raises(ValueError, match="known parsers: deepseek_r1, qwen3"):
        ServerSettings(["m"], reasoning_parser="granite")
    assert ServerSettings(["m"], reasoning_parser="deepseek_r1").reasoning_parser == "deepseek_r1"
