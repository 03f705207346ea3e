"""Llama 3.1/3.2 JSON tool calls: the whole output is call objects separated by semicolons.

<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "f", ...}
"""

from __future__ import annotations

from typing import ClassVar

from cluster.openai.tool_parsers.base import ToolCallStream, ToolParser
from cluster.openai.tool_parsers.scanner import JSON_WHITESPACE, ScanError
from cluster.openai.tool_parsers.stream import CallSequence, ScanningStream

PYTHON_TAG = "<|python_tag|>"

# Where the stream is: before the first "{" (whitespace and the tag), after the tag, in the calls.
_LEAD, _AFTER_TAG, _CALLS = range(3)


class Llama3JsonToolParser(ToolParser):
    """The Llama 3 JSON format.

    The output is, after optional whitespace and an optional `<|python_tag|>`, one or more call
    objects (`{"name": ..., "parameters": {...}}`, or "arguments") separated by ";", and nothing
    else but whitespace; it then has no content. Output that does not start with "{" there is plain
    content; output that does but is not such calls (other JSON, text after the calls) is content
    too, with no calls. The tag is an ordinary text match, so it may be kept or skipped in
    detokenizing.
    """

    name: ClassVar[str] = "llama3_json"

    def stream(self) -> ToolCallStream:
        """A fresh streaming state for one choice."""
        return _Llama3JsonStream()


class _Llama3JsonStream(ScanningStream):
    def __init__(self) -> None:
        super().__init__()
        self._state = _LEAD
        self._lead_start: int | None = None  # where the tag starts, once a non-space arrived
        self._calls_seq = CallSequence(opener=None, separator=";", closer=None)

    def _step(self, pos: int) -> None:
        ch = self._text[pos]
        if self._state == _LEAD:
            if self._lead_start is None and ch in JSON_WHITESPACE:
                return
            if self._lead_start is None and ch == "{":
                self._state = _CALLS
            else:
                if self._lead_start is None:
                    self._lead_start = pos
                lead = self._text[self._lead_start : pos + 1]
                if not PYTHON_TAG.startswith(lead):
                    raise ScanError("not a JSON tool call")
                if lead == PYTHON_TAG:
                    self._state = _AFTER_TAG
                return
        elif self._state == _AFTER_TAG:
            if ch in JSON_WHITESPACE:
                return
            if ch != "{":
                raise ScanError(f"{PYTHON_TAG} not followed by a JSON object")
            self._state = _CALLS
        self._step_sequence(self._calls_seq, pos)

    def _end(self) -> None:
        if self._state != _CALLS or not self._calls_seq.complete:
            raise ScanError("not a complete JSON tool call")
        self._drop(len(self._text))
