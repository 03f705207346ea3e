"""POST /v1/completions: one engine request per prompt, choices numbered prompt-major
(`prompt_index * n + sequence_index`), as vLLM and OpenAI do."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import AsyncIterator, Sequence

from starlette.requests import Request
from starlette.responses import Response

from cluster.openai.protocol import (
    LOGPROB_FLOOR,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
)
from cluster.openai.serving_engine import (
    EnginePrompt,
    OpenAIServing,
    ServingCall,
    raise_on_error,
    random_id,
)
from engine.frontend.logprobs import Logprob
from engine.outputs import CompletionOutput, RequestOutput

PositionLogprobs = dict[int, Logprob] | None


@dataclasses.dataclass
class _ChoiceState:
    """How far a streamed choice has got: for the echo prefix and the logprobs' text offsets."""

    started: bool = False
    text_offset: int = 0
    finished: bool = False


class OpenAIServingCompletion(OpenAIServing):
    """The completions handler."""

    async def create_completion(self, request: CompletionRequest, raw_request: Request) -> Response | None:
        model, lora_request = self.resolve_model(request.model)
        await self.check_engine()
        prompts = self._tokenize(request)
        structure = request.requested_structure()
        params = []
        for prompt in prompts:
            prompt_params = request.sampling_params(
                self.max_tokens(len(prompt.token_ids), request.max_tokens),
                logprobs=request.logprobs,
                # Echoed prompts come with their own logprobs, as in OpenAI's legacy API.
                prompt_logprobs=request.logprobs if request.echo else None,
                best_of=request.best_of,
                structured_outputs=structure,
            )
            self.validate(prompt, prompt_params, request.cache_salt)
            params.append(prompt_params)
        request_id = random_id("cmpl")
        outputs = self.generate(
            request_id, prompts, params, request.priority, request.timeout, request.cache_salt, lora_request
        )
        call = ServingCall(request, model, request_id, prompts, outputs)
        return await self.respond(call, raw_request, self._stream, self._collect)

    def _tokenize(self, request: CompletionRequest) -> list[EnginePrompt]:
        raw = request.prompt
        if isinstance(raw, str) or (raw and isinstance(raw[0], int)):
            raw = [raw]  # type: ignore[list-item]
        prompts = []
        for item in raw:
            if isinstance(item, str):
                ids = self.tokenizer(item, add_special_tokens=request.add_special_tokens).input_ids
                prompts.append(EnginePrompt(ids, item))
            else:
                prompts.append(EnginePrompt(list(item)))
        return prompts

    def _prompt_text(self, prompt: EnginePrompt) -> str:
        if prompt.text is None:
            prompt.text = self.tokenizer.decode(prompt.token_ids)
        return prompt.text

    async def _collect(self, call: ServingCall[CompletionRequest]) -> CompletionResponse:
        request, prompts = call.request, call.prompts
        finals: dict[int, RequestOutput] = {}
        async with contextlib.aclosing(call.outputs):
            async for index, output in call.outputs:
                raise_on_error(output)
                finals[index] = output
        choices = []
        num_generated = 0
        for prompt_index, prompt in enumerate(prompts):
            final = finals[prompt_index]
            for seq in final.outputs:
                num_generated += len(seq.token_ids)
                index = prompt_index * request.n + seq.index
                choices.append(
                    self._choice(request, prompt, index, seq, final.prompt_logprobs, 0, request.echo)
                )
        choices.sort(key=lambda choice: choice.index)
        return CompletionResponse(
            id=call.request_id,
            model=call.model,
            choices=choices,
            usage=self.usage(
                prompts, num_generated, sum(final.num_cached_tokens for final in finals.values())
            ),
        )

    def _choice(
        self,
        request: CompletionRequest,
        prompt: EnginePrompt,
        index: int,
        seq: CompletionOutput,
        prompt_logprobs: list[PositionLogprobs] | None,
        text_offset: int,
        echo: bool,
    ) -> CompletionChoice:
        """A choice (or a streamed choice's delta) from a sequence's text, tokens and logprobs,
        with the prompt in front when echoing; `text_offset` is where its text starts in the choice."""
        text, token_ids, logprobs = seq.text, list(seq.token_ids), list(seq.logprobs or [])
        if echo:
            text = self._prompt_text(prompt) + text
            token_ids = [*prompt.token_ids, *token_ids]
            logprobs = [*(prompt_logprobs or [None] * len(prompt.token_ids)), *logprobs]
        choice_logprobs = None
        if request.logprobs is not None:
            choice_logprobs = self._logprobs(token_ids, logprobs, request.logprobs, text_offset)
        return CompletionChoice(
            index=index,
            text=text,
            logprobs=choice_logprobs,
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
        )

    def _logprobs(
        self, token_ids: list[int], positions: Sequence[PositionLogprobs], num_top: int, text_offset: int
    ) -> CompletionLogprobs:
        """The legacy logprobs lists. At each position `top_logprobs` holds the chosen token and the
        `num_top` most likely ones (vLLM's choice); the first prompt token has no logprob."""
        result = CompletionLogprobs()
        for token_id, position in zip(token_ids, positions, strict=True):
            if position is None:
                token, logprob, top = self.tokenizer.decode([token_id]), None, None
            else:
                chosen = position[token_id]
                token, logprob = chosen.decoded_token or "", max(chosen.logprob, LOGPROB_FLOOR)
                top = {
                    candidate.decoded_token or "": max(candidate.logprob, LOGPROB_FLOOR)
                    for rank, candidate in enumerate(position.values())
                    if rank <= num_top
                }
            result.tokens.append(token)
            result.token_logprobs.append(logprob)
            result.top_logprobs.append(top)
            result.text_offset.append(text_offset)
            text_offset += len(token)
        return result

    async def _stream(self, call: ServingCall[CompletionRequest]) -> AsyncIterator[CompletionResponse]:
        """A chunk per choice delta, the choice's last one with its finish reason; then the usage."""
        request, prompts = call.request, call.prompts
        states: dict[int, _ChoiceState] = {}
        # A delta carries the prompt's logprobs once; every echoing choice of the prompt needs them.
        prompt_logprobs: dict[int, list[PositionLogprobs]] = {}
        num_cached: dict[int, int] = {}
        num_generated = 0
        async with contextlib.aclosing(call.outputs):
            async for prompt_index, output in call.outputs:
                raise_on_error(output)
                num_cached[prompt_index] = output.num_cached_tokens
                if output.prompt_logprobs:
                    prompt_logprobs[prompt_index] = output.prompt_logprobs
                for seq in output.outputs:
                    index = prompt_index * request.n + seq.index
                    state = states.setdefault(index, _ChoiceState())
                    if state.finished or not (seq.text or seq.token_ids or seq.finish_reason):
                        continue
                    num_generated += len(seq.token_ids)
                    choice = self._choice(
                        request,
                        prompts[prompt_index],
                        index,
                        seq,
                        prompt_logprobs.get(prompt_index),
                        text_offset=state.text_offset,
                        echo=request.echo and not state.started,
                    )
                    state.started, state.finished = True, seq.finish_reason is not None
                    state.text_offset += len(choice.text)
                    yield CompletionResponse(id=call.request_id, model=call.model, choices=[choice])
        if request.include_usage:
            yield CompletionResponse(
                id=call.request_id,
                model=call.model,
                choices=[],
                usage=self.usage(prompts, num_generated, sum(num_cached.values())),
            )
