"""The JSON schemas the structured-output tests (and benchmarks/structured_outputs.py) hold the model to.

Varied on purpose: enums and consts, bounded integers and numbers, nested objects, arrays with
minItems / maxItems, bounded strings and patterns, anyOf, $ref, optional properties,
additionalProperties: false. Every string, array and number is bounded, so that even a small model
sampling at temperature 1.0 ends its output well within the tests' max_tokens.
"""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class SchemaCase:
    """A schema and a prompt that asks for it."""

    name: str
    schema: dict[str, Any]
    prompt: str


def _obj(
    properties: dict[str, Any], required: list[str] | None = None, closed: bool = True
) -> dict[str, Any]:
    schema: dict[str, Any] = {
        "type": "object",
        "properties": properties,
        "required": list(properties) if required is None else required,
    }
    if closed:
        schema["additionalProperties"] = False
    return schema


def _str(max_length: int = 16, **extra: Any) -> dict[str, Any]:
    return {"type": "string", "maxLength": max_length, **extra}


def _int(low: int, high: int) -> dict[str, Any]:
    return {"type": "integer", "minimum": low, "maximum": high}


SCHEMAS = [
    SchemaCase("person", _obj({"name": _str(24), "age": _int(0, 120)}), "Describe a person."),
    SchemaCase("color_enum", _obj({"color": {"enum": ["red", "green", "blue"]}}), "Pick a color."),
    SchemaCase(
        "weather",
        _obj({"city": _str(20), "celsius": _int(-40, 50), "sky": {"enum": ["sunny", "cloudy", "rain"]}}),
        "What is the weather in Paris?",
    ),
    SchemaCase("bool_flag", _obj({"ok": {"type": "boolean"}}), "Is the sky blue?"),
    SchemaCase(
        "tags",
        _obj({"tags": {"type": "array", "items": _str(10), "minItems": 1, "maxItems": 3}}),
        "Tag a blog post.",
    ),
    SchemaCase(
        "nested_address",
        _obj({"name": _str(20), "address": _obj({"street": _str(24), "zip": _str(5, pattern="^[0-9]{5}$")})}),
        "Give a customer with an address.",
    ),
    SchemaCase(
        "deep_nesting",
        _obj({"a": _obj({"b": _obj({"c": _obj({"d": _int(0, 9)})})})}),
        "Fill in the nested values.",
    ),
    SchemaCase(
        "scores",
        _obj({"scores": {"type": "array", "items": _int(0, 100), "minItems": 2, "maxItems": 4}}),
        "List some test scores.",
    ),
    SchemaCase(
        "bounded_number",
        _obj({"price": {"type": "number", "minimum": 0, "maximum": 100, "multipleOf": 0.25}}),
        "Price a coffee.",
    ),
    SchemaCase(
        "any_of_shape",
        {
            "anyOf": [
                _obj({"kind": {"const": "circle"}, "radius": _int(1, 10)}),
                _obj({"kind": {"const": "square"}, "side": _int(1, 10)}),
            ]
        },
        "Describe a shape.",
    ),
    SchemaCase(
        "any_of_value",
        _obj({"value": {"anyOf": [_int(0, 1000), _str(12), {"type": "boolean"}, {"type": "null"}]}}),
        "Give any value.",
    ),
    SchemaCase(
        "optional_fields",
        _obj({"title": _str(20), "subtitle": _str(20), "pages": _int(1, 999)}, ["title"]),
        "Describe a book.",
    ),
    SchemaCase(
        "array_of_objects",
        _obj(
            {
                "items": {
                    "type": "array",
                    "items": _obj({"sku": _str(8), "qty": _int(1, 20)}),
                    "minItems": 1,
                    "maxItems": 3,
                }
            }
        ),
        "Write a shopping order.",
    ),
    SchemaCase("const_version", _obj({"version": {"const": 2}, "name": _str(12)}), "Name a release."),
    SchemaCase(
        "date_pattern",
        _obj({"date": _str(10, pattern="^[0-9]{4}-[0-9]{2}-[0-9]{2}$")}),
        "When is the meeting?",
    ),
    SchemaCase(
        "email_like",
        _obj({"email": _str(30, pattern="^[a-z]{1,10}@[a-z]{1,10}\\.com$")}),
        "Give an email address.",
    ),
    SchemaCase(
        "min_length",
        _obj({"code": {"type": "string", "minLength": 3, "maxLength": 6}}),
        "Invent a product code.",
    ),
    SchemaCase(
        "ref_defs",
        {
            "$defs": {"point": _obj({"x": _int(-10, 10), "y": _int(-10, 10)})},
            "type": "object",
            "properties": {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}},
            "required": ["start", "end"],
            "additionalProperties": False,
        },
        "Give a line segment.",
    ),
    SchemaCase("integer_root", _int(1, 6), "Roll a die."),
    SchemaCase("enum_root", {"enum": ["yes", "no", "maybe"]}, "Will it rain?"),
    SchemaCase("string_root", _str(20), "Name a fruit."),
    SchemaCase(
        "array_root",
        {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 2, "maxItems": 5},
        "Spell with a, b and c.",
    ),
    SchemaCase(
        "matrix",
        _obj(
            {
                "rows": {
                    "type": "array",
                    "items": {"type": "array", "items": _int(0, 9), "minItems": 2, "maxItems": 2},
                    "minItems": 2,
                    "maxItems": 2,
                }
            }
        ),
        "Write a 2x2 matrix.",
    ),
    SchemaCase(
        "event",
        _obj(
            {
                "title": _str(20),
                "day": {"enum": ["mon", "tue", "wed", "thu", "fri"]},
                "hour": _int(0, 23),
                "online": {"type": "boolean"},
            }
        ),
        "Plan an event.",
    ),
    SchemaCase(
        "nullable",
        _obj({"middle_name": {"anyOf": [_str(12), {"type": "null"}]}}),
        "What is your middle name?",
    ),
    SchemaCase(
        "recipe",
        _obj(
            {
                "dish": _str(20),
                "steps": {"type": "array", "items": _str(20), "minItems": 1, "maxItems": 3},
                "minutes": _int(1, 180),
            }
        ),
        "Give a quick recipe.",
    ),
    SchemaCase(
        "type_union",
        _obj({"id": {"type": ["integer", "string"], "minimum": 0, "maximum": 9999, "maxLength": 8}}),
        "Give an id.",
    ),
    SchemaCase(
        "exclusive_bounds",
        _obj({"percent": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 100}}),
        "How full is the glass?",
    ),
    SchemaCase(
        "inventory",
        _obj(
            {
                "store": _str(16),
                "stock": {
                    "type": "array",
                    "items": _obj({"item": {"enum": ["apple", "pear", "plum"]}, "count": _int(0, 50)}),
                    "minItems": 1,
                    "maxItems": 3,
                },
            }
        ),
        "Count the fruit in the store.",
    ),
    SchemaCase(
        "single_item_array",
        {"type": "array", "items": _int(0, 9), "minItems": 1, "maxItems": 1},
        "One digit in a list.",
    ),
    SchemaCase(
        "contact",
        _obj(
            {"name": _str(20), "phone": _str(12, pattern="^[0-9]{3}-[0-9]{4}$"), "vip": {"type": "boolean"}}
        ),
        "Add a contact.",
    ),
    SchemaCase(
        "review",
        _obj(
            {
                "stars": _int(1, 5),
                "verdict": {"enum": ["buy", "skip"]},
                "pros": {"type": "array", "items": _str(12), "maxItems": 2},
            }
        ),
        "Review a phone.",
    ),
]
