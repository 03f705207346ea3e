"""The request and response bodies of structured outputs and tool calls (OpenAI's, and vLLM's
`structured_outputs`), as pydantic models: the rest of the protocol is in protocol.py."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_serializer, model_validator

from engine.sampling_params import StructuredOutputsParams
from engine.structured.manager import check_structured_outputs


class JsonSchemaFormat(BaseModel):
    """`response_format.json_schema`: OpenAI's named schema (`strict` is always how it is enforced)."""

    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """`response_format`: plain text, any JSON object, or JSON that follows a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError('json_schema must be given exactly when type is "json_schema"')
        return self

    def structured_outputs(self) -> StructuredOutputsParams | None:
        """The constraint of this format; a ValueError naming the field when its schema is invalid
        or cannot be enforced."""
        if self.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        if self.type == "json_schema":
            assert self.json_schema is not None
            # A named schema without a schema (OpenAI allows it) is any JSON object.
            params = StructuredOutputsParams(json=self.json_schema.json_schema or {"type": "object"})
            try:
                check_structured_outputs(params)
            except ValueError as exc:
                raise ValueError(
                    str(exc).replace("structured_outputs.json", "response_format.json_schema.schema", 1)
                ) from None
            return params
        return None


class StructuredOutputsRequest(BaseModel):
    """vLLM's `structured_outputs` request field: exactly one constraint."""

    model_config = ConfigDict(extra="forbid")

    json_schema: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def params(self) -> StructuredOutputsParams:
        return StructuredOutputsParams(
            json=self.json_schema,
            regex=self.regex,
            choice=self.choice,
            grammar=self.grammar,
            json_object=self.json_object,
        )


class FunctionCall(BaseModel):
    """A function call: its name and its arguments, a JSON object as text."""

    name: str
    arguments: str


class ToolCall(BaseModel):
    """A tool call of an assistant message (in a reply, or in a conversation sent back)."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


def call_template_dict(function: FunctionCall) -> dict[str, Any]:
    """A call as chat templates take it: arguments parsed (as sent when they are not JSON)."""
    try:
        arguments: Any = json.loads(function.arguments)
    except json.JSONDecodeError:
        arguments = function.arguments
    return {"name": function.name, "arguments": arguments}


class FunctionDefinition(BaseModel):
    """A tool's function: its name, what it does, and the JSON schema of its arguments."""

    name: str = Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_.:-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatCompletionTool(BaseModel):
    """One entry of `tools`."""

    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    """`tool_choice` naming the one function the reply must call."""

    type: Literal["function"] = "function"
    function: NamedFunction


class DeltaFunctionCall(BaseModel):
    """A piece of a streamed function call: the name on its first piece, then argument fragments."""

    name: str | None = None
    arguments: str | None = None

    @model_serializer(mode="wrap")
    def _drop_absent(self, handler: Any) -> dict[str, Any]:
        return {key: value for key, value in handler(self).items() if value is not None}


class DeltaToolCall(BaseModel):
    """A piece of tool call number `index` of a streamed message; its first piece carries the id."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall

    @model_serializer(mode="wrap")
    def _drop_absent(self, handler: Any) -> dict[str, Any]:
        return {key: value for key, value in handler(self).items() if value is not None}
