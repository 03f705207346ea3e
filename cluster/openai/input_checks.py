"""Checks on the raw JSON of a request, before pydantic reads it: every string must be valid Unicode.

JSON may carry lone surrogate escapes ("\\ud800") that no UTF-8 text can hold; the tokenizer (and the
response's own encoding) fail on them, so they are refused up front with the field that held one.
The walk is iterative: a deeply nested body costs no recursion.
"""

from __future__ import annotations

from typing import Any

from pydantic_core import PydanticCustomError

INVALID_UNICODE = "invalid_unicode"


def _is_valid_unicode(text: str) -> bool:
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def find_invalid_string(value: Any) -> list[str | int] | None:
    """The path (keys and list indices) to the first string or key in `value` that is not valid
    Unicode, or None when every one is."""
    stack: list[tuple[list[str | int], Any]] = [([], value)]
    while stack:
        path, item = stack.pop()
        if isinstance(item, str):
            if not _is_valid_unicode(item):
                return path
        elif isinstance(item, dict):
            for key, child in item.items():
                if isinstance(key, str) and not _is_valid_unicode(key):
                    return path  # the key itself cannot be named; its container is
                stack.append(([*path, key], child))
        elif isinstance(item, list | tuple):
            stack.extend(([*path, index], child) for index, child in enumerate(item))
    return None


def format_path(path: list[str | int]) -> str:
    """`["messages", 0, "content"]` as `messages[0].content`."""
    text = ""
    for part in path:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else part)
    return text or "body"


def check_unicode(data: Any) -> Any:
    """`data` unchanged; a validation error of type `invalid_unicode`, naming the field, otherwise."""
    path = find_invalid_string(data)
    if path is None:
        return data
    field = format_path(path)
    raise PydanticCustomError(
        INVALID_UNICODE,
        "{field} is not valid Unicode: it holds a lone surrogate (an unpaired \\ud800-\\udfff escape)",
        {"field": field, "param": str(path[0]) if path else None},
    )
