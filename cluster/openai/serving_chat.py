"""POST /v1/chat/completions: the messages rendered with the tokenizer's chat template, then one
engine request; its output as text, or as tool calls (cluster/openai/tool_calling.py), after the
reasoning (cluster/openai/chat_reply.py)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from http import HTTPStatus

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from cluster.openai.chat_reply import ROLE, ReplyParsers
from cluster.openai.errors import OpenAIError
from cluster.openai.protocol import (
    LOGPROB_FLOOR,
    ChatChoiceLogprobs,
    ChatCompletionChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    ChatLogprobContent,
    ChatTokenLogprob,
    DeltaMessage,
)
from cluster.openai.reasoning_parsers import ReasoningParser, get_reasoning_parser
from cluster.openai.serving_engine import OpenAIServing, ServingCall, raise_on_error, random_id
from cluster.openai.serving_models import OpenAIServingModels
from cluster.openai.tool_calling import ToolPlan, plan_tools
from engine.frontend.logprobs import Logprob
from engine.outputs import CompletionOutput
from engine.sampling_params import StructuredOutputsParams


def _token_logprob(candidate: Logprob) -> dict:
    token = candidate.decoded_token or ""
    return {"token": token, "logprob": max(candidate.logprob, LOGPROB_FLOOR), "bytes": list(token.encode())}


def chat_logprobs(seq: CompletionOutput, num_top: int) -> ChatChoiceLogprobs:
    """OpenAI's chat logprobs of a sequence's tokens: each chosen token with the `num_top` most
    likely ones at its position, most likely first."""
    content = []
    for token_id, position in zip(seq.token_ids, seq.logprobs or [], strict=True):
        top = sorted(
            (candidate for candidate in position.values() if (candidate.rank or 0) <= num_top),
            key=lambda candidate: candidate.rank or 0,
        )
        content.append(
            ChatLogprobContent(
                **_token_logprob(position[token_id]),
                top_logprobs=[ChatTokenLogprob(**_token_logprob(candidate)) for candidate in top],
            )
        )
    return ChatChoiceLogprobs(content=content)


def _finish_reason(finish_reason: str | None, called_tools: bool) -> str | None:
    """OpenAI's "tool_calls" for a reply that ended (not cut short) with tool calls."""
    return "tool_calls" if called_tools and finish_reason == "stop" else finish_reason


class OpenAIServingChat(OpenAIServing):
    """The chat completions handler."""

    def __init__(
        self,
        models: OpenAIServingModels,
        default_timeout_s: float | None = None,
        prompt_tokens_details: bool = False,
        auto_tool_parser: str | None = None,
        reasoning_parser: str | None = None,
    ) -> None:
        super().__init__(models, default_timeout_s, prompt_tokens_details)
        # The --tool-call-parser of tool_choice "auto"; None without --enable-auto-tool-choice.
        self.auto_tool_parser = auto_tool_parser
        # The --reasoning-parser's format (ValueError for an unknown name, before serving).
        self.reasoning_parser: type[ReasoningParser] | None = (
            get_reasoning_parser(reasoning_parser) if reasoning_parser else None
        )

    async def create_chat_completion(
        self, request: ChatCompletionRequest, raw_request: Request
    ) -> Response | None:
        model, lora_request = self.resolve_model(request.model)
        await self.check_engine()
        tools = plan_tools(request, self.auto_tool_parser)
        prompt = self.render_chat(
            request.messages,
            request.add_generation_prompt,
            request.continue_final_message,
            request.chat_template_kwargs,
            tools=tools.template_tools,
        )
        constraint = self._constraint(request, tools)
        params = request.sampling_params(
            self.max_tokens(len(prompt.token_ids), request.requested_max_tokens),
            logprobs=(request.top_logprobs or 0) if request.logprobs else None,
            prompt_logprobs=None,
            structured_outputs=constraint,
        )
        if tools.parser is not None and tools.parser.needs_special_tokens:
            # The format's markers are special tokens: the text must keep them to be parsed.
            params = msgspec.structs.replace(params, skip_special_tokens=False)
        self.validate(prompt, params, request.cache_salt)
        request_id = random_id("chatcmpl")
        outputs = self.generate(
            request_id,
            [prompt],
            [params],
            request.priority,
            request.timeout,
            request.cache_salt,
            lora_request,
        )
        reasoning = None
        if self.reasoning_parser is not None:
            reasoning = self.reasoning_parser.for_request(
                prompt.text or "", request.chat_template_kwargs, constrained=constraint is not None
            )
        reply = ReplyParsers(reasoning, tools.parser, request.include_reasoning)
        call = ServingCall(request, model, request_id, [prompt], outputs, reply)
        return await self.respond(call, raw_request, self._stream, self._collect)

    @staticmethod
    def _constraint(request: ChatCompletionRequest, tools: ToolPlan) -> StructuredOutputsParams | None:
        """The one constraint on the output: the tool choice's, or the requested structure."""
        structure = request.requested_structure()
        if tools.structured_outputs is not None and structure is not None:
            raise OpenAIError(
                HTTPStatus.BAD_REQUEST,
                "tool_choice forces tool calls, which response_format or structured_outputs cannot "
                "constrain as well: use one of them",
                "tool_choice",
            )
        return tools.structured_outputs or structure

    async def _collect(self, call: ServingCall[ChatCompletionRequest]) -> ChatCompletionResponse:
        request = call.request
        final = None
        async with contextlib.aclosing(call.outputs):
            async for _, output in call.outputs:
                raise_on_error(output)
                final = output
        assert final is not None, "the engine ended a request without a final output"
        choices = []
        for seq in sorted(final.outputs, key=lambda seq: seq.index):
            message = call.reply.message(seq.text)
            choices.append(
                ChatCompletionChoice(
                    index=seq.index,
                    message=message,
                    logprobs=chat_logprobs(seq, request.top_logprobs or 0) if request.logprobs else None,
                    finish_reason=_finish_reason(seq.finish_reason, bool(message.tool_calls)),
                    stop_reason=seq.stop_reason,
                )
            )
        num_generated = sum(len(seq.token_ids) for seq in final.outputs)
        return ChatCompletionResponse(
            id=call.request_id,
            model=call.model,
            choices=choices,
            usage=self.usage(call.prompts, num_generated, final.num_cached_tokens),
        )

    async def _stream(
        self, call: ServingCall[ChatCompletionRequest]
    ) -> AsyncIterator[ChatCompletionStreamResponse]:
        """The role of every choice first, then a chunk per reasoning, content or tool-call delta,
        each choice's last one with its finish reason; then the usage."""

        request = call.request

        def chunk(*choices: ChatCompletionStreamChoice) -> ChatCompletionStreamResponse:
            return ChatCompletionStreamResponse(id=call.request_id, model=call.model, choices=list(choices))

        for index in range(request.n):
            yield chunk(ChatCompletionStreamChoice(index=index, delta=DeltaMessage(role=ROLE, content="")))
        streams = {index: call.reply.stream() for index in range(request.n)}
        called_tools: set[int] = set()
        finished: set[int] = set()
        num_generated = num_cached = 0
        async with contextlib.aclosing(call.outputs):
            async for _, output in call.outputs:
                raise_on_error(output)
                num_cached = output.num_cached_tokens
                for seq in output.outputs:
                    if seq.index in finished:
                        continue
                    num_generated += len(seq.token_ids)
                    step = streams[seq.index].feed(seq.text, seq.finish_reason is not None)
                    if step.tool_calls:
                        called_tools.add(seq.index)
                    # Tokens that completed no text yet (part of a character, or of a tag held back)
                    # still have logprobs.
                    if not (step or seq.finish_reason or (request.logprobs and seq.token_ids)):
                        continue
                    if seq.finish_reason is not None:
                        finished.add(seq.index)
                    yield chunk(
                        ChatCompletionStreamChoice(
                            index=seq.index,
                            delta=step.message(),
                            logprobs=chat_logprobs(seq, request.top_logprobs or 0)
                            if request.logprobs
                            else None,
                            finish_reason=_finish_reason(seq.finish_reason, seq.index in called_tools),
                            stop_reason=seq.stop_reason,
                        )
                    )
        if request.include_usage:
            final_usage = self.usage(call.prompts, num_generated, num_cached)
            yield ChatCompletionStreamResponse(
                id=call.request_id, model=call.model, choices=[], usage=final_usage
            )
