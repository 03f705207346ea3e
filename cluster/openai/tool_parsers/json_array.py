"""The calls of `tool_choice="required"`: the JSON array of call objects that the server's grammar
forces, `[{"name": "get_weather", "parameters": {"city": "Paris"}}, ...]`."""

from __future__ import annotations

from typing import ClassVar

from cluster.openai.tool_parsers.base import ToolCallStream, ToolParser
from cluster.openai.tool_parsers.scanner import ScanError
from cluster.openai.tool_parsers.stream import CallSequence, ScanningStream


class JsonArrayToolParser(ToolParser):
    """The server's own format for required tool calls (not a model's): the whole output is a JSON
    array of at least one object `{"name": <string>, "parameters": <object>}` ("arguments" is
    accepted too), whitespace allowed around every part. Each call's arguments are its "parameters"
    object as written. Output that is not such an array is content with no calls."""

    name: ClassVar[str] = "json_array"

    def stream(self) -> ToolCallStream:
        """A fresh streaming state for one choice."""
        return _JsonArrayStream()


class _JsonArrayStream(ScanningStream):
    def __init__(self) -> None:
        super().__init__()
        self._array = CallSequence(opener="[", separator=",", closer="]")

    def _step(self, pos: int) -> None:
        # After the closing "]" only whitespace may follow, which _step_sequence checks too.
        self._step_sequence(self._array, pos)

    def _end(self) -> None:
        if not self._array.complete:
            raise ScanError("the output ends inside the array of calls")
        self._drop(len(self._text))
