"""OpenAI's request and response bodies, with vLLM's extra sampling fields, as pydantic models.

Requests accept fields this server does not know and ignore them (the route logs which), as vLLM
does: clients of newer API versions send fields that change nothing here. Fields that would change
the answer but are not implemented (suffix) are refused with a 400 instead of being ignored silently.

Every value is range-checked before it reaches the engine: strings must be valid Unicode, floats
finite, integers within 64 bits (the engine's wire format), and the fields below carry vLLM's limits
(SamplingParams and the input processor check the rest, naming the field and the limit).
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Generic, Literal, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    computed_field,
    field_validator,
    model_serializer,
    model_validator,
)

from cluster.openai.input_checks import check_unicode
from cluster.openai.protocol_tools import (
    ChatCompletionTool,
    DeltaToolCall,
    NamedToolChoice,
    ResponseFormat,
    StructuredOutputsRequest,
    ToolCall,
    call_template_dict,
)
from engine.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

# JSON has no -inf: vLLM reports impossible tokens with this floor, and so do we.
LOGPROB_FLOOR = -9999.0
# OpenAI's (and vLLM's) bound on chat top_logprobs.
MAX_TOP_LOGPROBS = 20
# Each stop string is matched after every generated token; vLLM sets no bound, the body limit does
# here too, but a list this long is a mistake (or an attack) rather than a use.
MAX_STOP_STRINGS = 256
# The longest per-request deadline (`timeout`): a day; a longer one is a mistake, not a use.
MAX_TIMEOUT_S = 86400.0
# The engine's requests travel as msgpack, whose integers are 64-bit.
Int64 = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]
TokenId = Annotated[int, Field(ge=0, le=2**63 - 1)]
Count = Annotated[int, Field(ge=0, le=2**63 - 1)]


class OpenAIBaseModel(BaseModel):
    """Base of the request models: unknown fields are kept aside (see `ignored_fields`)."""

    # NaN and Infinity parse from JSON (Python's json accepts them) but are no sampling setting.
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        return check_unicode(data)

    def ignored_fields(self) -> list[str]:
        return sorted(self.model_extra or {})


class StreamOptions(BaseModel):
    """`stream_options`: whether the stream ends with a usage chunk."""

    include_usage: bool = False


class SamplingRequest(OpenAIBaseModel):
    """Fields shared by completions and chat completions: OpenAI's, then vLLM's extras."""

    model: str | None = None
    n: Int64 = 1
    temperature: float | None = None
    top_p: float | None = None
    seed: Int64 | None = None
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP_STRINGS)] | None = None
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # vLLM's extras (the openai client sends them through `extra_body`).
    top_k: Int64 | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: Count = 0
    ignore_eos: bool = False
    stop_token_ids: list[TokenId] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    priority: Int64 = 0
    # Only requests with the same salt share prefix-cache blocks (isolates tenants: no one can time
    # another's cached prompts); it should be secret and unguessable, such as 256 random bits.
    cache_salt: str | None = None
    # raypage's extension: seconds after which the request is aborted (a 504, or an error event in a
    # stream); None: the server's --request-timeout, if any.
    timeout: Annotated[float, Field(gt=0, le=MAX_TIMEOUT_S)] | None = None
    # The shape of the output, enforced by the engine: OpenAI's field, or vLLM's.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None

    @field_validator("cache_salt")
    @classmethod
    def _salt_not_empty(cls, value: str | None) -> str | None:
        if value is not None and not value:
            # vLLM's rule: a salt that came out empty must not silently share the unsalted cache.
            raise ValueError("must be a non-empty string if given")
        return value

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> SamplingRequest:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options can only be given when stream is true")
        return self

    def requested_structure(self) -> StructuredOutputsParams | None:
        """The constraint `response_format` or `structured_outputs` asks for (at most one of them);
        ValueError naming the field when it is not a valid one."""
        from_format = self.response_format.structured_outputs() if self.response_format else None
        if from_format is not None and self.structured_outputs is not None:
            raise ValueError("response_format and structured_outputs cannot both be given: use one of them")
        if self.structured_outputs is not None:
            return self.structured_outputs.params()
        return from_format

    def sampling_params(
        self,
        max_tokens: int,
        logprobs: int | None,
        prompt_logprobs: int | None,
        best_of: int | None = None,
        structured_outputs: StructuredOutputsParams | None = None,
    ) -> SamplingParams:
        """The engine's SamplingParams; raises ValueError naming a field with a bad value.

        Streams ask for deltas (each output carries only what is new, tagged by sequence index);
        whole responses ask for the final output only.
        """
        try:
            logit_bias = {int(token): bias for token, bias in (self.logit_bias or {}).items()}
        except ValueError:
            raise ValueError("logit_bias keys must be token ids (integers as strings)") from None
        optional = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "repetition_penalty": self.repetition_penalty,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
        }
        return SamplingParams(
            n=self.n,
            best_of=best_of,
            seed=self.seed,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            include_stop_str_in_output=self.include_stop_str_in_output,
            ignore_eos=self.ignore_eos,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            logit_bias=logit_bias or None,
            output_kind=RequestOutputKind.DELTA if self.stream else RequestOutputKind.FINAL_ONLY,
            structured_outputs=structured_outputs,
            # None means "the default": leave SamplingParams' own.
            **{name: value for name, value in optional.items() if value is not None},
        )

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


Prompt = str | list[str] | list[TokenId] | list[list[TokenId]]


class CompletionRequest(SamplingRequest):
    """POST /v1/completions."""

    prompt: Prompt
    max_tokens: Int64 | None = 16  # OpenAI's and vLLM's default; null means "up to the context"
    best_of: Int64 | None = None
    echo: bool = False
    logprobs: Count | None = None
    suffix: str | None = None
    add_special_tokens: bool = True

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value: str | None) -> str | None:
        if value:
            raise ValueError("suffix is not supported")
        return value

    @field_validator("prompt")
    @classmethod
    def _prompt_not_empty(cls, value: Prompt) -> Prompt:
        if isinstance(value, list) and not value:
            raise ValueError("prompt must not be an empty list")
        return value


class TextContentPart(BaseModel):
    """A text part of a message's content; other part types (images, audio) are not supported."""

    type: Literal["text"]
    text: str


class ChatMessage(OpenAIBaseModel):
    """One message of a conversation, passed to the chat template with any extra keys it has."""

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[TextContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's calls
    tool_call_id: str | None = None  # the call a tool message answers

    def template_dict(self) -> dict[str, Any]:
        """The message as the chat template sees it: content parts joined into one string, and tool
        calls with their arguments as objects (Hugging Face templates render them with `tojson`)."""
        content = self.content
        if isinstance(content, list):
            content = "\n".join(part.text for part in content)
        message = {**(self.model_extra or {}), "role": self.role, "content": content or ""}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_calls:
            message["tool_calls"] = [
                {"id": call.id, "type": call.type, "function": call_template_dict(call.function)}
                for call in self.tool_calls
            ]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


class ChatCompletionRequest(SamplingRequest):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Int64 | None = None
    max_tokens: Int64 | None = None  # deprecated by OpenAI in favor of max_completion_tokens
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    tools: list[ChatCompletionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    # vLLM's extras for the chat template.
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM's: false leaves the reasoning (--reasoning-parser) out of the reply.
    include_reasoning: bool = True

    @model_validator(mode="after")
    def _check_supported(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs set to true")
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
        return self

    @field_validator("chat_template_kwargs")
    @classmethod
    def _no_request_template(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value and "chat_template" in value:
            # vLLM's rule too: the server's template, never one a client sends, is rendered.
            raise ValueError("a chat template given with the request is not accepted")
        return value

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


# ---- responses ----


def _now() -> int:
    return int(time.time())


class PromptTokenUsageInfo(BaseModel):
    """Usage's `prompt_tokens_details` (OpenAI's, which vLLM sends with --enable-prompt-tokens-details)."""

    cached_tokens: int | None = None


class UsageInfo(BaseModel):
    """Token counts of a request: every prompt once, every returned sequence's tokens."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokenUsageInfo | None = None


class CompletionLogprobs(BaseModel):
    """The legacy completions logprobs object (parallel lists, one entry per token)."""

    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class ChoiceBase(BaseModel):
    """What every choice (or streamed choice delta) says: which one it is, and why it ended."""

    index: int
    finish_reason: str | None = None
    stop_reason: int | str | None = None


ChoiceT = TypeVar("ChoiceT", bound=ChoiceBase)


class ResponseBase(BaseModel, Generic[ChoiceT]):
    """What every completion response and stream chunk says; `object` names its kind."""

    id: str
    object: str
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChoiceT]
    usage: UsageInfo | None = None


class CompletionChoice(ChoiceBase):
    """One sequence of a completion, or one sequence's delta in a stream chunk."""

    text: str
    logprobs: CompletionLogprobs | None = None


class CompletionResponse(ResponseBase[CompletionChoice]):
    """A whole completion (`object` "text_completion"); stream chunks have the same shape."""

    object: Literal["text_completion"] = "text_completion"


class ChatTokenLogprob(BaseModel):
    """One candidate token: its text, log-probability and UTF-8 bytes."""

    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogprobContent(ChatTokenLogprob):
    """The chosen token of one position, with the most likely alternatives."""

    top_logprobs: list[ChatTokenLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(BaseModel):
    """A chat choice's logprobs: one entry per generated token."""

    content: list[ChatLogprobContent] | None = None


class ReasoningContentAlias(BaseModel):
    """The `reasoning` a --reasoning-parser split off (vLLM's name), sent under its older name
    `reasoning_content` too, which vLLM before 0.11, DeepSeek's API and their clients read."""

    reasoning: str | None = None

    @computed_field  # type: ignore[prop-decorator]
    @property
    def reasoning_content(self) -> str | None:
        return self.reasoning


class ChatResponseMessage(ReasoningContentAlias):
    """The assistant's reply: text, tool calls, or both; and the reasoning before them."""

    role: str = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)


class ChatCompletionChoice(ChoiceBase):
    """One sequence of a chat completion."""

    message: ChatResponseMessage
    logprobs: ChatChoiceLogprobs | None = None


class ChatCompletionResponse(ResponseBase[ChatCompletionChoice]):
    """A whole chat completion."""

    object: Literal["chat.completion"] = "chat.completion"
    usage: UsageInfo  # always, unlike a stream chunk's


class DeltaMessage(ReasoningContentAlias):
    """What a stream chunk adds to a message: the role on a choice's first chunk, then reasoning,
    content or pieces of tool calls."""

    role: str | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None

    @model_serializer(mode="wrap")
    def _drop_absent(self, handler: Any) -> dict[str, Any]:
        # OpenAI sends only the keys a delta sets: {"role": ..., "content": ""}, then {"content": ...}.
        return {key: value for key, value in handler(self).items() if value is not None}


class ChatCompletionStreamChoice(ChoiceBase):
    """One choice's delta in a chat stream chunk."""

    delta: DeltaMessage
    logprobs: ChatChoiceLogprobs | None = None


class ChatCompletionStreamResponse(ResponseBase[ChatCompletionStreamChoice]):
    """One chat stream chunk (`object` "chat.completion.chunk")."""

    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"


class ModelCard(BaseModel):
    """One entry of GET /v1/models."""

    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "raypage"
    root: str
    parent: str | None = None
    max_model_len: int


class ModelList(BaseModel):
    """GET /v1/models."""

    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    """OpenAI's error object."""

    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(BaseModel):
    """Every error body: {"error": {"message", "type", "param", "code"}}."""

    error: ErrorInfo
