"""Mistral tool calls after the `[TOOL_CALLS]` marker, in either of the two forms Mistral's
tokenizers use:

    Let me look.[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]   (v3)
    Let me look.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]add[ARGS]{"a": 1}  (v11+)
"""

from __future__ import annotations

import string
from typing import ClassVar

from cluster.openai.tool_parsers.base import ToolCallStream, ToolParser
from cluster.openai.tool_parsers.scanner import (
    JSON_WHITESPACE,
    JsonValueScanner,
    LiteralMatcher,
    ScanError,
    load_json,
)
from cluster.openai.tool_parsers.stream import CallSequence, ScanningStream

MARKER = "[TOOL_CALLS]"
ARGS_MARKER = "[ARGS]"
# The characters of a function name in the v11 form (OpenAI's rule for function names).
NAME_CHARS = frozenset(string.ascii_letters + string.digits + "_-")

# Where the stream is: in the content, after a `[TOOL_CALLS]`, in a v3 array, in a v11 name, in its
# `[ARGS]`, before its arguments' "{", in the arguments, after a call.
_CONTENT, _AFTER_MARKER, _ARRAY, _NAME, _ARGS_MARKER, _ARGS_OPEN, _ARGS, _AFTER_CALL = range(8)


class MistralToolParser(ToolParser):
    """The Mistral format, following vLLM's `mistral` parser.

    The content is the text before the first `[TOOL_CALLS]`. After it comes either a JSON array of
    call objects ("arguments" being each call's arguments object) or a function name, `[ARGS]` and
    the arguments object; the name may also run straight into the "{" (the v11 form detokenized
    with `[ARGS]` skipped). Further `[TOOL_CALLS]` markers may start more calls. Anything else
    after the marker (including text after the calls) makes the whole output content, with no calls.
    """

    name: ClassVar[str] = "mistral"
    needs_special_tokens: ClassVar[bool] = True

    def stream(self) -> ToolCallStream:
        """A fresh streaming state for one choice."""
        return _MistralStream()


class _MistralStream(ScanningStream):
    def __init__(self) -> None:
        super().__init__()
        self._state = _CONTENT
        self._array = CallSequence(opener="[", separator=",", closer="]")
        self._name_start = 0
        self._name_end: int | None = None
        self._args_marker = LiteralMatcher(ARGS_MARKER)
        self._args_start = 0
        self._args = JsonValueScanner()
        self._marker = LiteralMatcher(MARKER)

    def _advance(self, pos: int) -> int:
        if self._state != _CONTENT:
            return super()._advance(pos)
        pos, found = self._scan_content(pos, MARKER)
        if found:
            self._state = _AFTER_MARKER
        return pos

    def _step(self, pos: int) -> None:
        ch = self._text[pos]
        state = self._state
        if state == _AFTER_MARKER:
            self._step_after_marker(ch, pos)
        elif state == _ARRAY:
            self._step_sequence(self._array, pos)
            if self._array.complete:
                self._after_call()
        elif state == _NAME:
            self._step_name(ch, pos)
        elif state == _ARGS_MARKER:
            if self._args_marker.step(ch):
                self._state = _ARGS_OPEN
        elif state == _ARGS_OPEN:
            if ch == "{":
                self._start_arguments(pos)
            elif ch not in JSON_WHITESPACE:
                raise ScanError(f"{ARGS_MARKER} not followed by a JSON object")
        elif state == _ARGS:
            self._step_arguments(ch, pos)
        elif (ch not in JSON_WHITESPACE or self._marker.matched) and self._marker.step(ch):
            self._state = _AFTER_MARKER

    def _step_after_marker(self, ch: str, pos: int) -> None:
        if ch == "[":
            self._state = _ARRAY
            self._step_sequence(self._array, pos)
        elif ch in NAME_CHARS:
            self._name_start = pos
            self._name_end = None
            self._state = _NAME
        elif ch not in JSON_WHITESPACE:
            raise ScanError(f"{MARKER} not followed by calls")

    def _step_name(self, ch: str, pos: int) -> None:
        if ch in NAME_CHARS and self._name_end is None:
            return
        if self._name_end is None:
            self._name_end = pos
        if ch == "[":
            self._args_marker = LiteralMatcher(ARGS_MARKER)
            self._args_marker.step(ch)
            self._state = _ARGS_MARKER
        elif ch == "{":
            self._start_arguments(pos)
        elif ch not in JSON_WHITESPACE:
            raise ScanError(f"unexpected {ch!r} after a function name")

    def _start_arguments(self, pos: int) -> None:
        self._call_index = self._start_call(self._text[self._name_start : self._name_end], pos)
        self._args_sent = 0
        self._args_start = pos
        self._args = JsonValueScanner()
        self._state = _ARGS
        self._step_arguments("{", pos)

    def _step_arguments(self, ch: str, pos: int) -> None:
        # The arguments start with "{", so every character up to the closing "}" is theirs.
        self._args.step(ch)
        self._send_arguments_text(self._args_start, pos + 1)
        self._drop(pos + 1)
        if self._args.done:
            load_json(self._text[self._args_start : pos + 1])
            self._after_call()

    def _after_call(self) -> None:
        self._marker = LiteralMatcher(MARKER)
        self._state = _AFTER_CALL

    def _end(self) -> None:
        if self._state == _CONTENT:
            self._send_content(len(self._text))
        elif self._state == _AFTER_CALL and not self._marker.matched:
            self._drop(len(self._text))
        else:
            raise ScanError("the output ends inside the tool calls")
