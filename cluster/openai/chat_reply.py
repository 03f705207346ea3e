"""How a chat output's text becomes the assistant's reply: the reasoning split off first
(--reasoning-parser, cluster/openai/reasoning_parsers/), then the tool calls found in the rest
(cluster/openai/tool_calling.py). Tool parsers see only the content, never the reasoning (as in
vLLM), so a call the model only thought about is not made. A whole reply and the deltas of a stream
come from the same parsers and agree."""

from __future__ import annotations

import dataclasses

from cluster.openai.protocol import ChatResponseMessage, DeltaMessage
from cluster.openai.protocol_tools import DeltaFunctionCall, DeltaToolCall, FunctionCall, ToolCall
from cluster.openai.reasoning_parsers import ReasoningParser, ReasoningStream
from cluster.openai.tool_parsers import StreamDelta, ToolCallDelta, ToolCallStream, ToolParser

ROLE = "assistant"


@dataclasses.dataclass(frozen=True)
class ReplyParsers:
    """The parsers of one chat request's outputs; neither set: the text is the content."""

    # Splits off the reasoning; None without --reasoning-parser.
    reasoning: ReasoningParser | None = None
    # Finds tool calls in the content; None when the reply is text only.
    tools: ToolParser | None = None
    # The request's include_reasoning: false drops the reasoning from the reply (it is still split off).
    include_reasoning: bool = True

    def message(self, text: str) -> ChatResponseMessage:
        """The assistant's message for a whole output: its reasoning, and its content or the calls
        the tool parser finds in it."""
        reasoning: str | None = None
        content: str | None = text
        if self.reasoning is not None:
            # Both parts are null when empty (vLLM's), so all-reasoning output has null content.
            parts = self.reasoning.extract(text)
            reasoning, content = parts.reasoning, parts.content
        if not self.include_reasoning:
            reasoning = None
        if self.tools is None:
            return ChatResponseMessage(role=ROLE, content=content, reasoning=reasoning)
        extracted = self.tools.extract(content or "")
        calls = [
            ToolCall(id=call.id, function=FunctionCall(name=call.name, arguments=call.arguments))
            for call in extracted.calls
        ]
        return ChatResponseMessage(
            role=ROLE, content=extracted.content, tool_calls=calls, reasoning=reasoning
        )

    def stream(self) -> ReplyStream:
        """A fresh streaming state for one choice."""
        return ReplyStream(self)


@dataclasses.dataclass
class ReplyDelta:
    """One step of a choice's stream: a piece of reasoning, then content and tool-call pieces."""

    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCallDelta] = dataclasses.field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)

    def message(self) -> DeltaMessage:
        """OpenAI's delta: reasoning, content, and pieces of tool calls (each call's first piece with
        its id, type and name)."""
        calls = [
            DeltaToolCall(
                index=piece.index,
                id=piece.id,
                type="function" if piece.id is not None else None,
                function=DeltaFunctionCall(name=piece.name, arguments=piece.arguments),
            )
            for piece in self.tool_calls
        ]
        return DeltaMessage(
            content=self.content or None, reasoning=self.reasoning or None, tool_calls=calls or None
        )


class ReplyStream:
    """The streaming state of one choice: each piece of its text through the reasoning stream, and
    the content that comes out of it through the tool-call stream."""

    def __init__(self, parsers: ReplyParsers) -> None:
        self._include_reasoning = parsers.include_reasoning
        self._reasoning: ReasoningStream | None = parsers.reasoning.stream() if parsers.reasoning else None
        self._tools: ToolCallStream | None = parsers.tools.stream() if parsers.tools else None

    def feed(self, text: str, finished: bool) -> ReplyDelta:
        """What the choice sends for its next text (and, at its end, everything held back)."""
        reasoning, content = "", text
        if self._reasoning is not None:
            parts = self._reasoning.feed(text)
            if finished:
                parts += self._reasoning.finish()
            reasoning, content = parts.reasoning, parts.content
        step = StreamDelta(content=content)
        if self._tools is not None:
            step = self._tools.feed(content)
            if finished:
                end = self._tools.finish()
                step = StreamDelta(step.content + end.content, step.tool_calls + end.tool_calls)
        return ReplyDelta(reasoning if self._include_reasoning else "", step.content, step.tool_calls)
