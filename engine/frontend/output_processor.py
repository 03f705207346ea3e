"""Core outputs in, user-facing `RequestOutput`s out. Detokenization, stop strings and logprob
formatting happen here, in the front end, never in the engine core.

What a request's outputs carry follows its `output_kind`: CUMULATIVE (everything so far),
DELTA (per sequence, only the text, tokens and logprobs since its last output; only the sequences
that changed) or FINAL_ONLY (nothing until the end).
"""

from __future__ import annotations

import dataclasses
import time

from tokenizers import Tokenizer
from transformers import PreTrainedTokenizerBase

from engine.frontend.detokenizer import IncrementalDetokenizer, backend_tokenizer
from engine.frontend.logprobs import Logprob, make_logprobs_dict
from engine.frontend.stats import FinishedRequestStats, IterationStats, RequestTimes
from engine.outputs import CompletionOutput, EngineCoreOutput, EngineCoreRequest, LogprobsLists, RequestOutput
from engine.sampling_params import RequestOutputKind

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
        # What DELTA outputs have carried so far.
        self.num_sent_chars = 0
        self.num_sent_tokens = 0
        self.sent_finish = False

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def full_text(self) -> str:
        return self.detokenizer.text if self.detokenizer else self.text

    def completion(self, index: int, with_cumulative_logprob: bool) -> CompletionOutput:
        return CompletionOutput(
            index=index,
            text=self.full_text,
            token_ids=list(self.token_ids),
            cumulative_logprob=self.cumulative_logprob if with_cumulative_logprob else None,
            logprobs=self.logprobs,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
        )

    def delta(self, index: int, with_cumulative_logprob: bool) -> CompletionOutput | None:
        """What is new since the last delta, or None if nothing is (not even the finish)."""
        text = self.full_text[self.num_sent_chars :]
        token_ids = self.token_ids[self.num_sent_tokens :]
        if not text and not token_ids and self.sent_finish == self.finished:
            return None
        # One logprobs entry per token, so the token count slices them too.
        logprobs = self.logprobs[self.num_sent_tokens :] if self.logprobs is not None else None
        self.num_sent_chars += len(text)
        self.num_sent_tokens += len(token_ids)
        self.sent_finish = self.finished
        return CompletionOutput(
            index=index,
            text=text,
            token_ids=token_ids,
            cumulative_logprob=self.cumulative_logprob if with_cumulative_logprob else None,
            logprobs=logprobs,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
        )


class RequestState:
    """Front-end state of one request: its sequences so far."""

    def __init__(self, request: EngineCoreRequest, prompt: str | None, tokenizer: Tokenizer) -> None:
        self.request_id = request.request_id
        self.prompt = prompt
        self.prompt_token_ids = request.prompt_token_ids
        self.lora_request = request.lora_request
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
        self.times = RequestTimes(request.arrival_time, len(request.prompt_token_ids))
        self.sent_prompt_logprobs = False  # DELTA: they go with the first output only

    @property
    def finished(self) -> bool:
        if self.core_finished:
            return True
        # Sequences the front end stopped (stop strings) end without a word from the core.
        return len(self.seqs) == self.params.num_sequences and all(seq.finished for seq in self.seqs.values())

    @property
    def finish_reason(self) -> str:
        """The request's reason: its first sequence's (they seldom differ)."""
        first = self.seqs[min(self.seqs)] if self.seqs else None
        return (first.finish_reason if first else None) or "abort"

    def update(self, output: EngineCoreOutput, now: float, stats: IterationStats | None) -> StopEvent | None:
        """Apply one core output; a StopEvent when it completed a stop string."""
        seq = self.seqs.get(output.index) or self._new_sequence(output.index)
        if stats is not None:
            # Tokens after a stop string never reach the user and are not counted.
            self.times.observe(output, 0 if seq.finished else len(output.new_token_ids), now, stats)
        self.num_cached_tokens = output.num_cached_tokens
        self.error = output.error or self.error
        self.core_finished |= output.request_finished
        if output.prompt_logprobs is not None and self.prompt_logprobs is not None:
            self.prompt_logprobs += self._logprob_dicts(
                output.prompt_logprobs,
                self.params.prompt_logprobs,
                self.prompt_token_ids[: len(self.prompt_logprobs)],
            )
        if seq.finished:
            return None  # tokens the core made before it learned of a stop string
        new_tokens = output.new_token_ids
        if seq.detokenizer is not None:
            visible = new_tokens
            if isinstance(output.stop_reason, int) and not self.params.include_stop_str_in_output:
                visible = visible[:-1]  # vLLM shows no text for a stop token id
            num_read = seq.detokenizer.add_tokens_until_stop(visible)
            if seq.detokenizer.stop_reason is not None:
                new_tokens = new_tokens[:num_read]  # none past the token that completed the stop string
        seq.token_ids += new_tokens
        if output.cumulative_logprob is not None:
            seq.cumulative_logprob = output.cumulative_logprob
        if output.new_logprobs is not None and seq.logprobs is not None:
            seq.logprobs += self._logprob_dicts(
                output.new_logprobs.slice(0, len(new_tokens)),
                self.params.logprobs,
                [*self.prompt_token_ids, *seq.token_ids],
            )
        if seq.detokenizer is None:
            seq.text = self.tokenizer.decode(seq.token_ids, skip_special_tokens=True)
        elif seq.detokenizer.stop_reason is not None:
            seq.finish_reason, seq.stop_reason = "stop", seq.detokenizer.stop_reason
            return None if output.finished else StopEvent(self.request_id, output.index, seq.stop_reason)
        if output.finish_reason is not None:
            seq.finish_reason, seq.stop_reason = str(output.finish_reason), output.stop_reason
            if seq.detokenizer is not None:
                seq.detokenizer.finish()
        return None

    def make_output(self) -> RequestOutput | None:
        """The output to hand the user now, per the request's output_kind; None when there is none."""
        kind = self.params.output_kind
        finished = self.finished
        if kind == RequestOutputKind.FINAL_ONLY and not finished:
            return None
        picks_at_end = self.params.num_sequences > self.params.n
        seqs = sorted(self.seqs.values(), key=lambda seq: seq.index)
        if finished and picks_at_end:
            # best_of: the n sequences with the highest cumulative log-probability.
            seqs = sorted(seqs, key=lambda seq: seq.cumulative_logprob or 0.0, reverse=True)[: self.params.n]
        with_cumulative = self.params.logprobs is not None or self.beam_search is not None
        prompt_logprobs = self.prompt_logprobs
        if kind == RequestOutputKind.DELTA:
            if picks_at_end and not finished:
                return None  # which sequences the user gets is known only at the end
            completions = [
                delta
                for rank, seq in enumerate(seqs)
                if (delta := seq.delta(rank, with_cumulative)) is not None
            ]
            if not completions and not finished:
                return None  # (a prefill chunk: nothing to show yet)
            if self.sent_prompt_logprobs:
                prompt_logprobs = None
            self.sent_prompt_logprobs = True
        else:
            completions = [seq.completion(rank, with_cumulative) for rank, seq in enumerate(seqs)]
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=completions,
            finished=finished,
            num_cached_tokens=self.num_cached_tokens,
            prompt_logprobs=prompt_logprobs,
            error=self.error,
            lora_request=self.lora_request,
        )

    def abort(self) -> RequestOutput:
        """Finish every sequence as aborted; the last output (finished) to hand the user."""
        for index in range(self.params.num_sequences if self.beam_search is None else 0):
            if index not in self.seqs:
                self._new_sequence(index)
        for seq in self.seqs.values():
            if not seq.finished:
                seq.finish_reason = "abort"
        self.core_finished = True
        output = self.make_output()
        assert output is not None  # a finished request always has one
        return output

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

    def abort_requests(
        self, request_ids: list[str], finished_stats: list[FinishedRequestStats] | None = None
    ) -> list[RequestOutput]:
        """Forget requests; the last output (finish_reason "abort") of each that was live (unknown or
        finished ids are no-ops). With `finished_stats`, each one's stats are added to it."""
        now = time.time()
        results = []
        for request_id in request_ids:
            state = self.requests.pop(request_id, None)
            if state is not None:
                results.append(state.abort())
                if finished_stats is not None:
                    finished_stats.append(state.times.finish("abort", now))
        return results

    def process_outputs(
        self, outputs: list[EngineCoreOutput], stats: IterationStats | None = None
    ) -> tuple[list[RequestOutput], list[StopEvent]]:
        """The RequestOutputs these outputs produced (per output_kind), and the stop strings matched.

        With `stats`, what the batch brought (tokens, latencies, finished requests) is added to it.
        """
        now = time.time()
        touched: dict[str, RequestState] = {}
        stops = []
        for output in outputs:
            state = self.requests.get(output.request_id)
            if state is None:
                continue  # aborted by the user while its step was running
            stop = state.update(output, now, stats)
            if stop is not None:
                stops.append(stop)
            touched[output.request_id] = state
        results = []
        for request_id, state in touched.items():
            if state.finished:
                del self.requests[request_id]
                if stats is not None:
                    stats.finished_requests.append(state.times.finish(state.finish_reason, now))
            result = state.make_output()
            if result is not None:
                results.append(result)
        return results, stops

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)
