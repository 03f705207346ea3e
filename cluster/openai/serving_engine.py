"""What the completion and chat handlers share: model names, the context check, validation, and
running a request's prompts through the engine, within the request's deadline."""

from __future__ import annotations

import contextlib
import dataclasses
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from http import HTTPStatus
from typing import Any, Generic, TypeVar

import jinja2
from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import Response

from cluster.openai.chat_reply import ReplyParsers
from cluster.openai.engine_client import EngineClient
from cluster.openai.errors import OpenAIError
from cluster.openai.protocol import ChatMessage, PromptTokenUsageInfo, UsageInfo
from cluster.openai.serving_models import OpenAIServingModels
from cluster.openai.streaming import (
    PrimedStream,
    SSEResponse,
    merge_streams,
    run_until_disconnect,
    sse_stream,
    within_deadline,
)
from engine.frontend.tokenizer import render_chat_prompt
from engine.lora.request import LoRARequest
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams


@dataclasses.dataclass
class EnginePrompt:
    """A tokenized prompt: its ids, and its text when the client sent text."""

    token_ids: list[int]
    text: str | None = None

    def engine_input(self, cache_salt: str | None) -> dict[str, Any]:
        """The prompt as the engine (and a Serve router, which hashes its blocks) takes it."""
        prompt: dict[str, Any] = {"prompt": self.text, "prompt_token_ids": self.token_ids}
        if cache_salt is not None:
            prompt["cache_salt"] = cache_salt
        return prompt


RequestT = TypeVar("RequestT", bound=BaseModel)


@dataclasses.dataclass
class ServingCall(Generic[RequestT]):
    """One API call in flight: what the client asked, the model name it addressed, the response's
    id, its tokenized prompts, and the engine's outputs for them (tagged with the prompt index)."""

    request: RequestT
    model: str
    request_id: str
    prompts: list[EnginePrompt]
    outputs: AsyncIterator[tuple[int, RequestOutput]]
    # How a chat output becomes the reply: reasoning, content, tool calls (cluster/openai/chat_reply.py).
    reply: ReplyParsers = dataclasses.field(default_factory=ReplyParsers)


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class OpenAIServing:
    """Base of the route handlers: one engine, the names it is served under and its adapters (`models`)."""

    def __init__(
        self,
        models: OpenAIServingModels,
        default_timeout_s: float | None = None,
        prompt_tokens_details: bool = False,
    ) -> None:
        self.models = models
        self.engine: EngineClient = models.engine
        self.default_timeout_s = default_timeout_s
        self.prompt_tokens_details = prompt_tokens_details
        self.tokenizer = self.engine.tokenizer
        self.max_model_len = self.engine.config.model.max_model_len

    def usage(
        self, prompts: list[EnginePrompt], num_completion_tokens: int, num_cached_tokens: int
    ) -> UsageInfo:
        """Every prompt counted once (however many sequences it has), and every returned token; with
        prompt_tokens_details, the prompt tokens the prefix cache held."""
        num_prompt_tokens = sum(len(prompt.token_ids) for prompt in prompts)
        details = (
            PromptTokenUsageInfo(cached_tokens=num_cached_tokens) if self.prompt_tokens_details else None
        )
        return UsageInfo(
            prompt_tokens=num_prompt_tokens,
            completion_tokens=num_completion_tokens,
            total_tokens=num_prompt_tokens + num_completion_tokens,
            prompt_tokens_details=details,
        )

    def resolve_model(self, requested: str | None) -> tuple[str, LoRARequest | None]:
        """The name a request addresses (the first served one when it names none) and the adapter it
        runs with, if it names one; 404 when nothing has that name."""
        return self.models.resolve(requested)

    async def check_engine(self) -> None:
        """Fail fast with 503 (EngineDeadError, saying why) when the engine is dead, before any work."""
        await self.engine.check_health()

    def max_tokens(self, num_prompt_tokens: int, requested: int | None) -> int:
        """Tokens to generate: as asked, or whatever the context leaves (vLLM's rule and messages)."""
        limit = self.max_model_len
        if requested is None:
            if num_prompt_tokens >= limit:
                raise OpenAIError(
                    HTTPStatus.BAD_REQUEST,
                    f"This model's maximum context length is {limit} tokens. However, your request has "
                    f"{num_prompt_tokens} input tokens. Please reduce the length of the input messages.",
                )
            return limit - num_prompt_tokens
        if num_prompt_tokens + requested > limit:
            raise OpenAIError(
                HTTPStatus.BAD_REQUEST,
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{num_prompt_tokens + requested} tokens ({num_prompt_tokens} in the messages, "
                f"{requested} in the completion). Please reduce the length of the messages or completion.",
            )
        return requested

    def render_chat(
        self,
        messages: list[ChatMessage],
        add_generation_prompt: bool,
        continue_final_message: bool = False,
        template_kwargs: dict[str, Any] | None = None,
        add_special_tokens: bool = False,
        tools: list[dict[str, Any]] | None = None,
    ) -> EnginePrompt:
        """Messages (and tools) rendered with the tokenizer's chat template, then tokenized; 400 if
        the template fails."""
        try:
            prompt = render_chat_prompt(
                self.tokenizer,
                [m.template_dict() for m in messages],
                add_generation_prompt,
                continue_final_message=continue_final_message,
                template_kwargs=template_kwargs,
                add_special_tokens=add_special_tokens,
                tools=tools,
            )
        except jinja2.TemplateError as exc:
            raise OpenAIError(
                HTTPStatus.BAD_REQUEST, f"The chat template failed: {exc}", "messages"
            ) from None
        return EnginePrompt(prompt["prompt_token_ids"], prompt["prompt"])

    async def respond(
        self,
        call: ServingCall,
        raw_request: Request,
        stream: Callable[[ServingCall], AsyncIterator[BaseModel]],
        collect: Callable[[ServingCall], Awaitable[BaseModel]],
    ) -> Response | None:
        """Server-sent events of `stream(call)` when the client asked for a stream, else the JSON of
        `collect(call)`; None (nobody to answer) once the client disconnected.

        A stream starts once the engine has sent its first output, so that what fails before then
        (the engine full or dead, the deadline passed) is an HTTP error status, not an error event.
        """
        if getattr(call.request, "stream", False):
            outputs = call.outputs
            first = await run_until_disconnect(raw_request, anext(outputs))
            if first is None:
                await outputs.aclose()  # type: ignore[attr-defined]
                return None
            call.outputs = PrimedStream(first, outputs)
            return SSEResponse(sse_stream(stream(call)))
        response = await run_until_disconnect(raw_request, collect(call))
        return Response(response.model_dump_json(), media_type="application/json") if response else None

    def validate(self, prompt: EnginePrompt, params: SamplingParams, cache_salt: str | None) -> None:
        """The engine's own checks (vocabulary, logprob and sequence limits, the cache salt), run
        before the response starts so that a bad request is a 400 and never a broken stream."""
        self.engine.input_processor.process("validation", prompt.engine_input(cache_salt), params)

    async def generate(
        self,
        request_id: str,
        prompts: list[EnginePrompt],
        params: list[SamplingParams],
        priority: int,
        timeout_s: float | None = None,
        cache_salt: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """The outputs of every prompt's engine request as they come, tagged with the prompt index;
        each prompt carries the request's `cache_salt`, and runs with its adapter `lora_request`.

        Leaving early (a client disconnect, an error, the deadline `timeout_s` seconds from now, else
        the server's default, passing: a 504) closes every engine stream, which aborts the requests
        still running and frees their blocks.
        """
        timeout_s = timeout_s or self.default_timeout_s
        # A base-model request passes no adapter at all, so that an engine client serving none need
        # not take the argument.
        adapter = {} if lora_request is None else {"lora_request": lora_request}
        streams = [
            self.engine.generate(
                prompt.engine_input(cache_salt),
                prompt_params,
                f"{request_id}-{index}",
                priority=priority,
                **adapter,
            )
            for index, (prompt, prompt_params) in enumerate(zip(prompts, params, strict=True))
        ]
        if lora_request is not None:
            self.models.count_requests(lora_request, len(streams))
        try:
            async with contextlib.aclosing(merge_streams(streams)) as merged:
                async for item in within_deadline(merged, timeout_s, _deadline_error):
                    yield item
        finally:
            for stream in streams:
                await stream.aclose()  # type: ignore[attr-defined]


def _deadline_error(timeout_s: float) -> OpenAIError:
    # 504 rather than 408: the client sent its request in time; the server gave up on generating.
    return OpenAIError(
        HTTPStatus.GATEWAY_TIMEOUT,
        f"The request did not finish within its timeout of {timeout_s:g} s and was aborted.",
        "timeout",
    )


def raise_on_error(output: RequestOutput) -> None:
    """A request the engine could not run (a prompt larger than the whole KV cache) is a 400."""
    if output.error:
        raise OpenAIError(HTTPStatus.BAD_REQUEST, output.error)
