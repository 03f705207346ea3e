"""Hermes 2/3 and Qwen 2.5/3 tool calls: JSON objects in `<tool_call>` blocks after the content.

I'll check the weather.
<tool_call>
{"name": "get_weather", "arguments": {"city": "Paris"}}
</tool_call>
"""

from __future__ import annotations

from typing import ClassVar

from cluster.openai.tool_parsers.base import ToolCallStream, ToolParser
from cluster.openai.tool_parsers.scanner import (
    JSON_WHITESPACE,
    CallObjectScanner,
    LiteralMatcher,
    ScanError,
    ends_with_marker,
)
from cluster.openai.tool_parsers.stream import ScanningStream

START = "<tool_call>"
END = "</tool_call>"

# Where the stream is: in the content before the first block, after a `<tool_call>` (whitespace,
# then "{"), in the call object, before the `</tool_call>`, between blocks.
_CONTENT, _OPEN, _OBJECT, _CLOSE, _BETWEEN = range(5)


class HermesToolParser(ToolParser):
    """The Hermes format, following vLLM's `hermes` parser.

    The content is the text before the first `<tool_call>`; text between or after the blocks is
    dropped. Each block holds one call object, "arguments" being its arguments object (sent as the
    raw text the model wrote). A last block cut short before `</tool_call>` (the model hit its token
    limit) is still a call if its JSON object is complete; otherwise, as for any block that is not
    one call object, the whole output is content with no calls. Unlike vLLM's regular expression,
    the scan knows JSON strings: a "</tool_call>" inside one is text, not the end of the block.
    """

    name: ClassVar[str] = "hermes"
    needs_special_tokens: ClassVar[bool] = True

    def stream(self) -> ToolCallStream:
        """A fresh streaming state for one choice."""
        return _HermesStream()


class _HermesStream(ScanningStream):
    def __init__(self) -> None:
        super().__init__()
        self._state = _CONTENT
        self._call: CallObjectScanner | None = None
        self._close = LiteralMatcher(END)
        self._between_start = 0

    def _advance(self, pos: int) -> int:
        if self._state != _CONTENT:
            return super()._advance(pos)
        pos, found = self._scan_content(pos, START)
        if found:
            self._state = _OPEN
        return pos

    def _step(self, pos: int) -> None:
        ch = self._text[pos]
        state = self._state
        if state == _OPEN:
            if ch == "{":
                self._call = self._begin_call_object(pos)
                self._step_call_object(self._call, pos)
                self._state = _OBJECT
            elif ch not in JSON_WHITESPACE:
                raise ScanError(f"{START} not followed by a JSON object")
        elif state == _OBJECT:
            assert self._call is not None
            if self._step_call_object(self._call, pos):
                self._close = LiteralMatcher(END)
                self._state = _CLOSE
        elif state == _CLOSE:
            if (ch not in JSON_WHITESPACE or self._close.matched) and self._close.step(ch):
                self._drop(pos + 1)
                self._between_start = pos + 1
                self._state = _BETWEEN
        elif state == _BETWEEN and ends_with_marker(self._text, self._between_start, pos + 1, START):
            # Drop the text between the blocks but keep the marker held back, as in _CONTENT.
            self._drop(pos + 1 - len(START))
            self._state = _OPEN

    def _end(self) -> None:
        if self._state == _CONTENT:
            self._send_content(len(self._text))
        elif self._state == _BETWEEN or (self._state == _CLOSE and not self._close.matched):
            self._drop(len(self._text))
        else:
            raise ScanError("the output ends inside a tool call")
