"""Character-by-character scanners that the tool-call streams share.

They tell where a bracketed or quoted span, a JSON value, a fixed marker or a JSON call object
(`{"name": ..., "arguments": {...}}`) starts and ends while the text is still arriving, without
parsing values: whatever they delimit is checked with `json.loads` (or `ast`) once complete.
Anything that cannot be the expected text raises `ScanError`.
"""

from __future__ import annotations

import json

NAME_KEY = "name"
# Llama 3 writes "parameters", the other formats "arguments"; either is accepted everywhere.
ARGUMENT_KEYS = ("arguments", "parameters")
JSON_WHITESPACE = " \t\r\n"
_CLOSERS = {"}": "{", "]": "[", ")": "("}
# The characters of a JSON number, true, false or null: such a value ends at the first other one.
_SCALAR_CHARS = frozenset("+-.0123456789eEtruefalsn")


class ScanError(ValueError):
    """The text is not, or stops being, tool-call output of the format."""


def load_json(text: str) -> object:
    """`json.loads`, raising `ScanError` for invalid JSON."""
    try:
        return json.loads(text)
    except ValueError as exc:
        raise ScanError(f"invalid JSON: {exc}") from exc


def load_json_string(text: str) -> str:
    """A JSON string token's value (the scanners hand over only complete string tokens)."""
    value = load_json(text)
    if not isinstance(value, str):
        raise ScanError("expected a JSON string")
    return value


def marker_prefix_len(text: str, region_start: int, end: int, marker: str) -> int:
    """The length of the longest proper prefix of `marker` that `text[region_start:end]` ends with:
    how much of the text before `end` must be held back in case the marker is arriving."""
    for length in range(min(len(marker) - 1, end - region_start), 0, -1):
        if text.startswith(marker[:length], end - length):
            return length
    return 0


def ends_with_marker(text: str, region_start: int, end: int, marker: str) -> bool:
    """Whether `text[region_start:end]` ends with `marker`."""
    return end - region_start >= len(marker) and text.startswith(marker, end - len(marker))


class BracketScanner:
    """The nesting of brackets and quoted strings (with backslash escapes) in code or JSON.

    `quotes` are the characters that open and close a string: '"' for JSON, both quotes for Python.
    A closing bracket that does not match the open one raises `ScanError`.
    """

    def __init__(self, quotes: str) -> None:
        self._quotes = quotes
        self._open: list[str] = []
        self._quote: str | None = None
        self._escaped = False

    @property
    def closed(self) -> bool:
        """Whether every bracket and string opened so far is closed again."""
        return not self._open and self._quote is None

    def step(self, ch: str) -> None:
        """Take the next character."""
        if self._quote is not None:
            if self._escaped:
                self._escaped = False
            elif ch == "\\":
                self._escaped = True
            elif ch == self._quote:
                self._quote = None
        elif ch in self._quotes:
            self._quote = ch
        elif ch in "{[(":
            self._open.append(ch)
        elif ch in _CLOSERS and (not self._open or self._open.pop() != _CLOSERS[ch]):
            raise ScanError(f"unbalanced {ch!r}")


class JsonValueScanner:
    """Where one JSON value ends, fed one character at a time from its first one.

    Objects, arrays and strings end with their closing character; numbers, true, false and null at
    the first character that cannot continue them, which is not part of the value.
    """

    def __init__(self) -> None:
        self._brackets = BracketScanner('"')
        self._scalar: bool | None = None  # None before the first character
        self.done = False

    def step(self, ch: str) -> bool:
        """Take the next character; False when the value ended just before it (a scalar's end)."""
        if self._scalar is None:
            self._scalar = ch in _SCALAR_CHARS
            if not self._scalar and ch not in '{["':
                raise ScanError(f"a JSON value cannot start with {ch!r}")
        elif self._scalar:
            if ch not in _SCALAR_CHARS:
                self.done = True
                return False
            return True
        self._brackets.step(ch)
        self.done = self._brackets.closed
        return True


class LiteralMatcher:
    """A fixed marker (such as "</tool_call>") matched one character at a time."""

    def __init__(self, literal: str) -> None:
        self.literal = literal
        self.matched = 0

    def step(self, ch: str) -> bool:
        """Take the next character; True once the whole marker has been seen."""
        if ch != self.literal[self.matched]:
            raise ScanError(f"expected {self.literal!r}")
        self.matched += 1
        return self.matched == len(self.literal)


# The states of CallObjectScanner, each naming what the next non-whitespace character must be.
_OPEN, _KEY_OR_CLOSE, _KEY, _IN_KEY, _COLON, _VALUE, _IN_VALUE, _COMMA_OR_CLOSE, _DONE = range(9)


class CallObjectScanner:
    """One JSON call object, `{"name": "f", "arguments": {...}}`, scanned from its "{".

    It finds the name (known as soon as its string closes) and the span of the arguments object in
    the text (growing while it arrives), so that a stream can send the arguments as the raw text the
    model wrote. Other keys are skipped. Once the closing "}" is seen the whole object is checked
    with `json.loads`. The arguments must be an object; a call without them has none ("{}").
    """

    def __init__(self, start: int) -> None:
        self.start = start
        self.name: str | None = None
        self.args_start: int | None = None
        self.args_end: int | None = None
        self.done = False
        self._state = _OPEN
        self._key: str | None = None
        self._key_start = 0
        self._value: JsonValueScanner | None = None
        self._value_start = 0
        self._key_text = BracketScanner('"')

    def args_span(self, end: int) -> tuple[int, int] | None:
        """The arguments' text seen in `text[:end]`, as (start, end) positions; None before it."""
        if self.args_start is None:
            return None
        return self.args_start, end if self.args_end is None else self.args_end

    def step(self, text: str, pos: int) -> None:
        """Take the character at `text[pos]` (all before it were taken)."""
        ch = text[pos]
        state = self._state
        if state == _IN_KEY:
            self._key_text.step(ch)
            if self._key_text.closed:
                self._key = load_json_string(text[self._key_start : pos + 1])
                self._state = _COLON
        elif state == _IN_VALUE:
            assert self._value is not None
            if not self._value.step(ch):
                self._end_value(text, pos)
                self._after_value(text, pos)
            elif self._value.done:
                self._end_value(text, pos + 1)
        elif ch in JSON_WHITESPACE and state != _DONE:
            pass
        elif state == _OPEN and ch == "{":
            self._state = _KEY_OR_CLOSE
        elif state in (_KEY_OR_CLOSE, _KEY) and ch == '"':
            self._key_start = pos
            self._key_text = BracketScanner('"')
            self._key_text.step(ch)
            self._state = _IN_KEY
        elif state == _COLON and ch == ":":
            self._state = _VALUE
        elif state == _VALUE:
            self._start_value(ch, pos)
        elif state in (_KEY_OR_CLOSE, _COMMA_OR_CLOSE):
            self._after_value(text, pos)
        else:
            raise ScanError(f"unexpected {ch!r} in a call object")

    def _start_value(self, ch: str, pos: int) -> None:
        if self._key == NAME_KEY:
            if ch != '"' or self.name is not None:
                raise ScanError('"name" must be given once, as a string')
        elif self._key in ARGUMENT_KEYS:
            if ch != "{" or self.args_start is not None:
                raise ScanError("the arguments must be given once, as an object")
            self.args_start = pos
        self._value = JsonValueScanner()
        self._value.step(ch)
        self._value_start = pos
        self._state = _IN_VALUE

    def _end_value(self, text: str, end: int) -> None:
        if self._key == NAME_KEY:
            name = load_json_string(text[self._value_start : end])
            if not name:
                raise ScanError("empty function name")
            self.name = name
        elif self._key in ARGUMENT_KEYS:
            self.args_end = end
        self._state = _COMMA_OR_CLOSE

    def _after_value(self, text: str, pos: int) -> None:
        ch = text[pos]
        if ch in JSON_WHITESPACE:
            return
        if ch == "," and self._state == _COMMA_OR_CLOSE:
            self._state = _KEY
        elif ch == "}":
            self._state = _DONE
            self.done = True
            load_json(text[self.start : pos + 1])
            if self.name is None:
                raise ScanError('a call object without "name"')
        else:
            raise ScanError(f"unexpected {ch!r} in a call object")
