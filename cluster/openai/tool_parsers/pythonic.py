"""Llama 3.2/4 pythonic tool calls: the whole output is a Python list of calls.

[get_weather(city='San Francisco', metric="celsius"), add(a=1, b=2.5)]
"""

from __future__ import annotations

import ast
import json
import warnings
from typing import ClassVar

from cluster.openai.tool_parsers.base import ToolCallStream, ToolParser
from cluster.openai.tool_parsers.scanner import BracketScanner, ScanError
from cluster.openai.tool_parsers.stream import ScanningStream

# What the next non-whitespace character may be: the list's "[", a call (the list's first element
# must be one), a call or "]" after a comma, a name's next character, the call's arguments up to
# its ")", "," or "]" after a call, nothing after the list.
_OPEN, _FIRST, _NEXT, _NAME, _ARGS, _AFTER, _DONE = range(7)


def parse_call(source: str) -> tuple[str, str]:
    """The name and JSON arguments of one call `name(key=literal, ...)`, parsed with `ast` (never
    evaluated): keyword arguments only, with literal values (tuples become lists)."""
    try:
        # Model output is no code of ours: warnings about it (such as an invalid escape sequence
        # like "\d" in a string) would only be noise in the server's log.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            # Parenthesized, as inside the list, a line break may come before the "(".
            node = ast.parse(f"({source})", mode="eval").body
    except (SyntaxError, ValueError, RecursionError) as exc:
        raise ScanError(f"not a Python call: {exc}") from exc
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
        raise ScanError("not a call of a plain name with keyword arguments")
    arguments: dict[str, object] = {}
    for keyword in node.keywords:
        if keyword.arg is None:
            raise ScanError("**kwargs in a tool call")
        try:
            arguments[keyword.arg] = ast.literal_eval(keyword.value)
        except (ValueError, TypeError, SyntaxError, RecursionError) as exc:
            raise ScanError(f"argument {keyword.arg!r} is not a literal") from exc
    try:
        # NaN and infinities are not JSON; sets, bytes and complex numbers raise TypeError.
        return node.func.id, json.dumps(arguments, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ScanError(f"arguments not expressible in JSON: {exc}") from exc


class PythonicToolParser(ToolParser):
    """The pythonic format, following vLLM's `pythonic` parser.

    The output (apart from surrounding whitespace) must be a list of calls, each sent whole (id,
    name and JSON arguments in one delta) as soon as its ")" arrives; until the text can no longer
    be the start of such a list it is held back. Output that is not such a list (other text, a
    positional or non-literal argument, text after the list) is content with no calls.
    """

    name: ClassVar[str] = "pythonic"

    def stream(self) -> ToolCallStream:
        """A fresh streaming state for one choice."""
        return _PythonicStream()


class _PythonicStream(ScanningStream):
    def __init__(self) -> None:
        super().__init__()
        self._state = _OPEN
        self._call_start = 0
        self._name_ended = False  # whitespace came after the name: only "(" may follow
        self._args = BracketScanner("'\"")

    def _step(self, pos: int) -> None:
        ch = self._text[pos]
        state = self._state
        if state == _ARGS:
            self._args.step(ch)
            if self._args.closed:
                name, arguments = parse_call(self._text[self._call_start : pos + 1])
                self._send_arguments(self._start_call(name, pos + 1), arguments)
                self._state = _AFTER
        elif state == _NAME:
            if ch == "(":
                self._args = BracketScanner("'\"")
                self._args.step(ch)
                self._state = _ARGS
            elif ch.isspace():
                self._name_ended = True
            elif self._name_ended or (ch != "_" and not ch.isalnum()):
                raise ScanError(f"unexpected {ch!r} after a function name")
        elif ch.isspace():
            pass
        elif state == _OPEN and ch == "[":
            self._state = _FIRST
        elif state in (_FIRST, _NEXT) and ch.isidentifier():
            self._call_start = pos
            self._name_ended = False
            self._state = _NAME
        elif state == _AFTER and ch == ",":
            self._state = _NEXT
        elif state in (_AFTER, _NEXT) and ch == "]":
            self._drop(pos + 1)
            self._state = _DONE
        else:
            raise ScanError(f"unexpected {ch!r} for a list of calls")

    def _end(self) -> None:
        if self._state != _DONE:
            raise ScanError("not a complete list of calls")
        self._drop(len(self._text))
