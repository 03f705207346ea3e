"""The data types of tool-call extraction and the interface every format's parser implements.

A parser turns a chat completion's output text into OpenAI tool calls, either from the whole text
(`ToolParser.extract`, for a non-streamed response) or from text deltas as they are generated
(`ToolParser.stream`, one `ToolCallStream` per choice). Both paths give the same calls and content.
"""

from __future__ import annotations

import abc
import dataclasses
import secrets
import string
from collections.abc import Iterable
from dataclasses import field
from typing import ClassVar

_ID_ALPHABET = string.ascii_letters + string.digits
_ID_LENGTH = 24


def new_call_id() -> str:
    """A fresh OpenAI-style tool call id: "call_" and 24 random letters and digits."""
    return "call_" + "".join(secrets.choice(_ID_ALPHABET) for _ in range(_ID_LENGTH))


@dataclasses.dataclass
class ToolCall:
    """One complete tool call."""

    name: str
    # A JSON object as text: what OpenAI's `function.arguments` carries.
    arguments: str
    id: str


@dataclasses.dataclass
class ExtractedToolCalls:
    """What the whole output holds: its tool calls and the text outside them."""

    calls: list[ToolCall]
    # None when the text outside the calls is empty or whitespace only.
    content: str | None


@dataclasses.dataclass
class ToolCallDelta:
    """One streamed piece of call number `index` (0-based, calls in the order they appear)."""

    index: int
    # Set on the call's first delta only, the whole name at once.
    id: str | None = None
    name: str | None = None
    # The next fragment of the arguments text.
    arguments: str = ""


@dataclasses.dataclass
class StreamDelta:
    """What one step of a stream sends: plain content and pieces of tool calls."""

    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


class ToolCallStream(abc.ABC):
    """The streaming state of one choice: fed the output text in pieces of any size, it returns what
    can be sent so far, holding back only text that may still turn out to be part of a call."""

    # True once the stream stopped parsing and passes the rest of the text on as content: the output
    # is not tool-call output of the format, or is malformed. The whole extraction then reports the
    # entire text as content and no calls, even if the stream had sent some calls before that point.
    fell_back: bool = False

    @abc.abstractmethod
    def feed(self, delta_text: str) -> StreamDelta:
        """The next piece of the output text; returns what can be sent now."""

    @abc.abstractmethod
    def finish(self) -> StreamDelta:
        """The end of the output: returns what was held back and can now be sent."""


class ToolParser(abc.ABC):
    """One tool-call format: whole extraction, and a fresh streaming state per choice."""

    name: ClassVar[str]
    # True when the format's markers are special tokens that detokenizing with
    # skip_special_tokens=True would drop (the server then keeps them).
    needs_special_tokens: ClassVar[bool] = False

    @abc.abstractmethod
    def stream(self) -> ToolCallStream:
        """A fresh streaming state for one choice."""

    def extract(self, text: str) -> ExtractedToolCalls:
        """The calls and content of the whole output.

        It runs the same stream over the whole text, so that both paths agree exactly; output the
        stream had to fall back on (malformed, or not calls at all) is content with no calls.
        """
        stream = self.stream()
        deltas = [stream.feed(text), stream.finish()]
        if stream.fell_back:
            return ExtractedToolCalls(calls=[], content=text if text.strip() else None)
        return join_deltas(deltas)


def join_deltas(deltas: Iterable[StreamDelta]) -> ExtractedToolCalls:
    """The calls and content that a sequence of stream deltas adds up to."""
    content: list[str] = []
    calls: list[ToolCall] = []
    for delta in deltas:
        content.append(delta.content)
        for piece in delta.tool_calls:
            if piece.index == len(calls):
                assert piece.id is not None and piece.name is not None, "a call's first delta names it"
                calls.append(ToolCall(name=piece.name, arguments="", id=piece.id))
            calls[piece.index].arguments += piece.arguments
    text = "".join(content)
    return ExtractedToolCalls(calls=calls, content=text if text.strip() else None)
