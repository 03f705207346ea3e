"""POST /v1/chat/completions: the messages rendered with the tokenizer's chat template, then one
engine request."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import Response

from cluster.openai.protocol import (
    LOGPROB_FLOOR,
    ChatChoiceLogprobs,
    ChatCompletionChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    ChatLogprobContent,
    ChatResponseMessage,
    ChatTokenLogprob,
    DeltaMessage,
)
from cluster.openai.serving_engine import OpenAIServing, ServingCall, raise_on_error, random_id
from engine.frontend.logprobs import Logprob
from engine.outputs import CompletionOutput

ROLE = "assistant"


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


class OpenAIServingChat(OpenAIServing):
    """The chat completions handler."""

    async def create_chat_completion(
        self, request: ChatCompletionRequest, raw_request: Request
    ) -> Response | None:
        model = self.resolve_model(request.model)
        await self.check_engine()
        prompt = self.render_chat(
            request.messages,
            request.add_generation_prompt,
            request.continue_final_message,
            request.chat_template_kwargs,
        )
        params = request.sampling_params(
            self.max_tokens(len(prompt.token_ids), request.requested_max_tokens),
            logprobs=(request.top_logprobs or 0) if request.logprobs else None,
            prompt_logprobs=None,
        )
        self.validate(prompt, params, request.cache_salt)
        request_id = random_id("chatcmpl")
        outputs = self.generate(
            request_id, [prompt], [params], request.priority, request.timeout, request.cache_salt
        )
        call = ServingCall(request, model, request_id, [prompt], outputs)
        return await self.respond(call, raw_request, self._stream, self._collect)

    async def _collect(self, call: ServingCall[ChatCompletionRequest]) -> ChatCompletionResponse:
        request = call.request
        final = None
        async with contextlib.aclosing(call.outputs):
            async for _, output in call.outputs:
                raise_on_error(output)
                final = output
        assert final is not None, "the engine ended a request without a final output"
        choices = [
            ChatCompletionChoice(
                index=seq.index,
                message=ChatResponseMessage(role=ROLE, content=seq.text),
                logprobs=chat_logprobs(seq, request.top_logprobs or 0) if request.logprobs else None,
                finish_reason=seq.finish_reason,
                stop_reason=seq.stop_reason,
            )
            for seq in sorted(final.outputs, key=lambda seq: seq.index)
        ]
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
        """The role of every choice first, then a chunk per content delta, each choice's last one
        with its finish reason; then the usage."""

        request = call.request

        def chunk(*choices: ChatCompletionStreamChoice) -> ChatCompletionStreamResponse:
            return ChatCompletionStreamResponse(id=call.request_id, model=call.model, choices=list(choices))

        for index in range(request.n):
            yield chunk(ChatCompletionStreamChoice(index=index, delta=DeltaMessage(role=ROLE, content="")))
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
                    # Tokens that completed no text yet (part of a character) still have logprobs.
                    if not (seq.text or seq.finish_reason or (request.logprobs and seq.token_ids)):
                        continue
                    if seq.finish_reason is not None:
                        finished.add(seq.index)
                    yield chunk(
                        ChatCompletionStreamChoice(
                            index=seq.index,
                            delta=DeltaMessage(content=seq.text or None),
                            logprobs=chat_logprobs(seq, request.top_logprobs or 0)
                            if request.logprobs
                            else None,
                            finish_reason=seq.finish_reason,
                            stop_reason=seq.stop_reason,
                        )
                    )
        if request.include_usage:
            final_usage = self.usage(call.prompts, num_generated, num_cached)
            yield ChatCompletionStreamResponse(
                id=call.request_id, model=call.model, choices=[], usage=final_usage
            )
