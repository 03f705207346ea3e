"""Core outputs in, user-facing `RequestOutput`s out: detokenization happens here, in the front end."""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

from engine.detokenizer import IncrementalDetokenizer, backend_tokenizer
from engine.outputs import CompletionOutput, EngineCoreOutput, EngineCoreRequest, RequestOutput


class RequestState:
    """Front-end state of one request: its text so far and how it ended."""

    def __init__(
        self, request: EngineCoreRequest, prompt: str | None, detokenizer: IncrementalDetokenizer
    ) -> None:
        self.request_id = request.request_id
        self.prompt = prompt
        self.prompt_token_ids = request.prompt_token_ids
        self.detokenizer = detokenizer
        self.token_ids: list[int] = []
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.num_cached_tokens = 0
        self.error: str | None = None

    def update(self, output: EngineCoreOutput) -> None:
        self.token_ids.extend(output.new_token_ids)
        self.detokenizer.add_tokens(output.new_token_ids)
        self.num_cached_tokens = output.num_cached_tokens
        if output.finish_reason is not None:
            self.finish_reason = str(output.finish_reason)
            self.stop_reason = output.stop_reason
            self.error = output.error

    def make_output(self) -> RequestOutput:
        completion = CompletionOutput(
            index=0,
            text=self.detokenizer.text,
            token_ids=list(self.token_ids),
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
        )
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=[completion],
            finished=self.finish_reason is not None,
            num_cached_tokens=self.num_cached_tokens,
            error=self.error,
        )


class OutputProcessor:
    """Keeps a RequestState per live request and turns each step's core outputs into RequestOutputs."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self._tokenizer = backend_tokenizer(tokenizer)
        self.requests: dict[str, RequestState] = {}

    def add_request(self, request: EngineCoreRequest, prompt: str | None) -> None:
        detokenizer = IncrementalDetokenizer(
            self._tokenizer, request.prompt_token_ids, request.sampling_params.skip_special_tokens
        )
        self.requests[request.request_id] = RequestState(request, prompt, detokenizer)

    def abort_requests(self, request_ids: list[str]) -> list[str]:
        """Forget requests; returns the ids that were live (the rest are no-ops)."""
        return [request_id for request_id in request_ids if self.requests.pop(request_id, None) is not None]

    def process_outputs(self, outputs: list[EngineCoreOutput]) -> list[RequestOutput]:
        results = []
        for output in outputs:
            state = self.requests.get(output.request_id)
            if state is None:
                continue  # aborted by the user while its step was running
            state.update(output)
            if output.finish_reason is not None:
                del self.requests[output.request_id]
            results.append(state.make_output())
        return results

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)
