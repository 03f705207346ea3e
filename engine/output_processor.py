"""Core outputs in, user-facing `RequestOutput`s out. Detokenization, stop strings and logprob
formatting happen here, in the front end, never in the engine core."""

from __future__ import annotations

import dataclasses

from tokenizers import Tokenizer
from transformers import PreTrainedTokenizerBase

from engine.detokenizer import IncrementalDetokenizer, backend_tokenizer
from engine.logprobs import Logprob, make_logprobs_dict
from engine.outputs import CompletionOutput, EngineCoreOutput, EngineCoreRequest, LogprobsLists, RequestOutput

Logprobs = list[dict[int, Logprob]]
# Preceding tokens a logprob's decoded text may need: a UTF-8 character spans at most 4 tokens.
_DECODE_CONTEXT = 4


@dataclasses.dataclass
class StopEvent:
    """A stop string the front end matched: the core must finish that sequence."""

    request_id: str
    index: int
    stop_reason: str


class SequenceState:
    """One generated sequence in the making: tokens, text, logprobs, and how it ended."""

    def __init__(self, index: int, detokenizer: IncrementalDetokenizer | None, wants_logprobs: bool) -> None:
        self.index = index
        self.detokenizer = detokenizer  # None for beam search, whose beams arrive whole
        self.token_ids: list[int] = []
        self.text = ""
        self.logprobs: Logprobs | None = [] if wants_logprobs else None
        self.cumulative_logprob: float | None = None
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def completion(self, index: int, with_cumulative_logprob: bool) -> CompletionOutput:
        return CompletionOutput(
            index=index,
            text=self.detokenizer.text if self.detokenizer else self.text,
            token_ids=list(self.token_ids),
            cumulative_logprob=self.cumulative_logprob if with_cumulative_logprob else None,
            logprobs=self.logprobs,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
        )


class RequestState:
    """Front-end state of one request: its sequences so far."""

    def __init__(self, request: EngineCoreRequest, prompt: str | None, tokenizer: Tokenizer) -> None:
        self.request_id = request.request_id
        self.prompt = prompt
        self.prompt_token_ids = request.prompt_token_ids
        self.params = request.sampling_params
        self.beam_search = request.beam_search
        self.tokenizer = tokenizer
        self.seqs: dict[int, SequenceState] = {}
        self.prompt_logprobs: list[dict[int, Logprob] | None] | None = (
            [None] if self.params.prompt_logprobs is not None else None
        )
        self.num_cached_tokens = 0
        self.error: str | None = None
        self.core_finished = False

    @property
    def finished(self) -> bool:
        if self.core_finished:
            return True
        # Sequences the front end stopped (stop strings) end without a word from the core.
        return len(self.seqs) == self.params.num_sequences and all(seq.finished for seq in self.seqs.values())

    def update(self, output: EngineCoreOutput) -> StopEvent | None:
        """Apply one core output; a StopEvent when it completed a stop string."""
        self.num_cached_tokens = output.num_cached_tokens
        self.error = output.error or self.error
        self.core_finished |= output.request_finished
        if output.prompt_logprobs is not None and self.prompt_logprobs is not None:
            self.prompt_logprobs += self._logprob_dicts(
                output.prompt_logprobs,
                self.params.prompt_logprobs,
                self.prompt_token_ids[: len(self.prompt_logprobs)],
            )
        seq = self.seqs.get(output.index) or self._new_sequence(output.index)
        if seq.finished:
            return None  # tokens the core made before it learned of a stop string
        seq.token_ids += output.new_token_ids
        if output.cumulative_logprob is not None:
            seq.cumulative_logprob = output.cumulative_logprob
        if output.new_logprobs is not None and seq.logprobs is not None:
            seq.logprobs += self._logprob_dicts(
                output.new_logprobs, self.params.logprobs, [*self.prompt_token_ids, *seq.token_ids]
            )
        if seq.detokenizer is None:
            seq.text = self.tokenizer.decode(seq.token_ids, skip_special_tokens=True)
        else:
            visible = output.new_token_ids
            if isinstance(output.stop_reason, int) and not self.params.include_stop_str_in_output:
                visible = visible[:-1]  # vLLM shows no text for a stop token id
            seq.detokenizer.add_tokens(visible)
            if seq.detokenizer.stop_reason is not None:
                seq.finish_reason, seq.stop_reason = "stop", seq.detokenizer.stop_reason
                return None if output.finished else StopEvent(self.request_id, output.index, seq.stop_reason)
        if output.finish_reason is not None:
            seq.finish_reason, seq.stop_reason = str(output.finish_reason), output.stop_reason
            if seq.detokenizer is not None:
                seq.detokenizer.finish()
        return None

    def make_output(self) -> RequestOutput:
        seqs = sorted(self.seqs.values(), key=lambda seq: seq.index)
        if self.finished and self.params.num_sequences > self.params.n:
            # best_of: the n sequences with the highest cumulative log-probability.
            seqs = sorted(seqs, key=lambda seq: seq.cumulative_logprob or 0.0, reverse=True)[: self.params.n]
        with_cumulative = self.params.logprobs is not None or self.beam_search is not None
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=[seq.completion(rank, with_cumulative) for rank, seq in enumerate(seqs)],
            finished=self.finished,
            num_cached_tokens=self.num_cached_tokens,
            prompt_logprobs=self.prompt_logprobs,
            error=self.error,
        )

    def _new_sequence(self, index: int) -> SequenceState:
        detokenizer = None
        if self.beam_search is None:
            detokenizer = IncrementalDetokenizer(
                self.tokenizer,
                self.prompt_token_ids,
                self.params.skip_special_tokens,
                self.params.stop,
                self.params.include_stop_str_in_output,
                min_tokens=self.params.min_tokens,
            )
        seq = SequenceState(index, detokenizer, self.params.logprobs is not None)
        self.seqs[index] = seq
        return seq

    def _logprob_dicts(self, lists: LogprobsLists, num_logprobs: int, context: list[int]) -> Logprobs:
        """vLLM's per-position dicts; `context` holds the tokens chosen before the first position."""
        dicts = []
        preceding = context[-_DECODE_CONTEXT:]
        for token_ids, logprobs, rank in zip(lists.token_ids, lists.logprobs, lists.ranks, strict=True):
            dicts.append(
                make_logprobs_dict(self.tokenizer, token_ids, logprobs, rank, num_logprobs, preceding)
            )
            preceding = [*preceding[1 - _DECODE_CONTEXT :], token_ids[0]]
        return dicts


class OutputProcessor:
    """Keeps a RequestState per live request and turns each step's core outputs into RequestOutputs."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self._tokenizer = backend_tokenizer(tokenizer)
        self.requests: dict[str, RequestState] = {}

    def add_request(self, request: EngineCoreRequest, prompt: str | None) -> None:
        self.requests[request.request_id] = RequestState(request, prompt, self._tokenizer)

    def abort_requests(self, request_ids: list[str]) -> list[str]:
        """Forget requests; returns the ids that were live (the rest are no-ops)."""
        return [request_id for request_id in request_ids if self.requests.pop(request_id, None) is not None]

    def process_outputs(self, outputs: list[EngineCoreOutput]) -> tuple[list[RequestOutput], list[StopEvent]]:
        """The RequestOutputs of the requests these outputs touched, and the stop strings matched."""
        touched: dict[str, RequestState] = {}
        stops = []
        for output in outputs:
            state = self.requests.get(output.request_id)
            if state is None:
                continue  # aborted by the user while its step was running
            stop = state.update(output)
            if stop is not None:
                stops.append(stop)
            touched[output.request_id] = state
        results = []
        for request_id, state in touched.items():
            if state.finished:
                del self.requests[request_id]
            results.append(state.make_output())
        return results, stops

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)
