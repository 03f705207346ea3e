"""One line of a batch job's JSONL input, parsed and checked before any engine is involved.

A line is `{"id": optional, "prompt": str}` or `{"id": optional, "messages": [chat messages]}`, plus
optional sampling fields with SamplingParams' names. Everything that can be checked without the
model is checked here, so that a bad line is reported with a reason and never reaches the engine.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import msgspec

from engine.sampling_params import SamplingParams

# A batch line yields one completion and its text, so fields that ask for several completions or
# for log-probabilities would be computed and then thrown away; output_kind is the engine's business.
UNSUPPORTED_FIELDS = frozenset({"n", "best_of", "logprobs", "prompt_logprobs", "output_kind"})
SAMPLING_FIELDS = frozenset(SamplingParams.__struct_fields__) - UNSUPPORTED_FIELDS
INPUT_FIELDS = frozenset({"id", "prompt", "messages"})


@dataclasses.dataclass(frozen=True)
class BatchLine:
    """A valid input line: where it was, what to generate from, and how to sample."""

    number: int
    id: str | int
    prompt: str | None
    messages: list[dict[str, Any]] | None
    sampling_params: SamplingParams


def parse_batch_line(number: int, text: str) -> BatchLine:
    """The line numbered `number` (from 1) as a BatchLine; raises ValueError saying what is wrong."""
    try:
        record = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not valid JSON ({exc})") from None
    if not isinstance(record, dict):
        raise ValueError(f"expected a JSON object, got {type(record).__name__}")
    unknown = sorted(set(record) - INPUT_FIELDS - SAMPLING_FIELDS - UNSUPPORTED_FIELDS)
    if unknown:
        raise ValueError(
            f"unknown field {unknown[0]!r}; a line holds id, prompt or messages, and SamplingParams fields"
        )
    unsupported = sorted(set(record) & UNSUPPORTED_FIELDS)
    if unsupported:
        raise ValueError(
            f"field {unsupported[0]!r} is not supported: each line gets one completion, without logprobs"
        )
    if ("prompt" in record) == ("messages" in record):
        raise ValueError("a line needs exactly one of 'prompt' and 'messages'")
    prompt = record.get("prompt")
    if "prompt" in record and not (isinstance(prompt, str) and prompt):
        raise ValueError("'prompt' must be a non-empty string")
    messages = record.get("messages")
    if "messages" in record:
        _check_messages(messages)
    line_id = record.get("id", number)
    # bool is an int in Python, but an id of true is surely a mistake.
    if isinstance(line_id, bool) or not isinstance(line_id, str | int):
        raise ValueError(f"'id' must be a string or an integer, got {json.dumps(line_id)}")
    sampling = {key: value for key, value in record.items() if key in SAMPLING_FIELDS}
    return BatchLine(number, line_id, prompt, messages, _sampling_params(sampling))


def _check_messages(messages: Any) -> None:
    if not isinstance(messages, list) or not messages:
        raise ValueError("'messages' must be a non-empty list of {'role': str, 'content': str} objects")
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or not all(
            isinstance(message.get(key), str) for key in ("role", "content")
        ):
            raise ValueError(f"messages[{index}] must be an object with string 'role' and 'content'")


def _sampling_params(fields: dict[str, Any]) -> SamplingParams:
    """SamplingParams from JSON values, type-checked; its own checks run in its __post_init__.

    str_keys lets logit_bias keep JSON's string keys ("1234": 5.0) for its integer token ids.
    """
    try:
        return msgspec.convert(fields, SamplingParams, str_keys=True)
    except msgspec.ValidationError as exc:
        raise ValueError(f"bad sampling field: {exc}") from None
