"""Failover for the separate ingress: a request whose LLMServer replica dies continues on another.

The ingress keeps, per request, what its stream has delivered so far (`StreamProgress`). When the
replica fails (its actor killed, its node removed, its engine dead) the request is resubmitted to a
healthy replica: the original prompt token ids plus the output token ids already delivered as the
new prompt, max_tokens and min_tokens reduced by them, the seed advanced past them
(`position_seed`: a seeded draw depends only on the seed and the output position), the sampling
settings otherwise the same. The client sees one stream: the continuation's outputs carry the
original request id, prompt, prompt token ids (so usage counts the original prompt) and cached-token
count, and their text comes from a detokenizer that the ingress primes with the original prompt and
the delivered tokens, so a character split across the seam, a stop string straddling it, and text
the dead replica held back (a possible stop string's start) come out as an uninterrupted run's.

A request that has delivered nothing is resubmitted unchanged, whatever its settings. One that has
delivered something resumes when it can continue exactly (one sequence, delta outputs, no
presence/frequency penalty: those count generated tokens, which became prompt tokens; no structured
output, whose grammar state stays in the failed replica), else it ends with an error that says why. A replica must take the request (send its first output) within
`failover_timeout_s` of the failure, or the request ends with an error.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import msgspec
from prometheus_client import CollectorRegistry, Counter
from tokenizers import Tokenizer

from cluster.metrics import PREFIX
from engine.exceptions import EngineDeadError
from engine.frontend.detokenizer import IncrementalDetokenizer
from engine.frontend.input_processor import PromptType
from engine.outputs import RequestOutput
from engine.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams
from engine.worker.input_batch import position_seed


@dataclasses.dataclass(frozen=True)
class FailoverSettings:
    """Whether the ingress resumes requests of a failed replica, and how long it waits for another."""

    enabled: bool = True
    timeout_s: float = 30.0


class FailoverMetrics:
    """The ingress's failover counters (vLLM has none), in the registry its /metrics renders."""

    def __init__(self, registry: CollectorRegistry, model_names: list[str]) -> None:
        def counter(name: str, doc: str) -> Counter:
            return Counter(PREFIX + name, doc, ["model_name"], registry=registry)

        resumed = counter(
            "failover_resumed_requests",
            "Requests in flight on a failed LLMServer replica that another replica took over",
        )
        failed = counter(
            "failover_failed_requests",
            "Requests in flight on a failed LLMServer replica that could not be resumed",
        )
        self.resumed = {name: resumed.labels(name) for name in model_names}
        self.failed = {name: failed.labels(name) for name in model_names}


class NotResumableError(EngineDeadError):
    """The replica failed after the stream had started, and this request cannot continue exactly."""


def resumable_problem(params: SamplingParams | BeamSearchParams) -> str | None:
    """Why a request that has delivered outputs cannot continue exactly on another replica, or None."""
    if isinstance(params, BeamSearchParams):
        return "beam search keeps its beams in the replica"
    if params.num_sequences > 1:
        return "requests with n > 1 or best_of > 1 are not resumed"
    if params.output_kind != RequestOutputKind.DELTA:
        return "only streams of deltas are resumed"
    if params.presence_penalty or params.frequency_penalty:
        return "presence and frequency penalties count the generated tokens, which would become prompt tokens"
    if params.structured_outputs is not None:
        return "a structured output's place in its grammar is kept by the replica that generated it"
    return None


class StreamProgress:
    """What one request's stream has delivered, and how to continue it on another replica."""

    def __init__(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | BeamSearchParams,
        tokenizer: Tokenizer,
    ) -> None:
        self.request_id = request_id
        self._prompt = prompt
        self._params = params
        self._tokenizer = tokenizer
        self._first: RequestOutput | None = None  # the original prompt's fields, as the replica saw them
        self.token_ids: list[int] = []  # the output tokens delivered (one sequence)
        self._num_chars = 0  # the characters of text delivered
        self._cumulative_logprob: float | None = None
        # Set once the request continues on another replica: the text of everything after the seam.
        self._detokenizer: IncrementalDetokenizer | None = None
        self._logprob_offset = 0.0
        self.finished = False

    def resubmission(self) -> tuple[PromptType, SamplingParams | BeamSearchParams]:
        """The prompt and settings that continue the request elsewhere; NotResumableError if none can."""
        if self._first is None:
            return self._prompt, self._params  # nothing delivered: start again
        problem = resumable_problem(self._params)
        if problem is not None:
            raise NotResumableError(
                f"the LLMServer replica running request {self.request_id} failed after it had sent "
                f"{len(self.token_ids)} tokens, and the request cannot be resumed on another replica: {problem}"
            )
        params = self._params
        assert isinstance(params, SamplingParams)  # beam search is not resumable
        sent = len(self.token_ids)
        detokenizer = IncrementalDetokenizer(
            self._tokenizer,
            self._first.prompt_token_ids,
            params.skip_special_tokens,
            params.stop,  # type: ignore[arg-type]  (a list after SamplingParams.__post_init__)
            params.include_stop_str_in_output,
            min_tokens=params.min_tokens,
        )
        detokenizer.add_tokens(self.token_ids)
        self._detokenizer = detokenizer
        self._logprob_offset = self._cumulative_logprob or 0.0
        resumed = msgspec.structs.replace(
            params,
            max_tokens=None if params.max_tokens is None else params.max_tokens - sent,
            min_tokens=max(0, params.min_tokens - sent),
            seed=None if params.seed is None else position_seed(params.seed, sent),
            prompt_logprobs=None,  # the first output carried them
        )
        prompt = {
            # The prompt's other keys (its cache_salt) carry over: the continuation is the same tenant's.
            **(self._prompt if isinstance(self._prompt, Mapping) else {}),
            "prompt": self._first.prompt,
            "prompt_token_ids": [*self._first.prompt_token_ids, *self.token_ids],
        }
        return prompt, resumed

    def deliver(self, output: RequestOutput) -> RequestOutput:
        """`output` as the client's stream continues with it, recorded."""
        if self._first is None:
            self._first = output
        if self._detokenizer is not None:
            output = self._continued(output, self._detokenizer, self._first)
        output.request_id = self.request_id
        for completion in output.outputs:
            self.token_ids += completion.token_ids
            self._num_chars += len(completion.text)
            self._cumulative_logprob = completion.cumulative_logprob
        self.finished = output.finished
        return output

    def _continued(
        self, output: RequestOutput, detokenizer: IncrementalDetokenizer, first: RequestOutput
    ) -> RequestOutput:
        """A continuation's output, with the original prompt's fields and the text after the seam."""
        params = self._params
        assert isinstance(params, SamplingParams)
        completions = []
        for completion in output.outputs:
            visible = completion.token_ids
            if isinstance(completion.stop_reason, int) and not params.include_stop_str_in_output:
                visible = visible[:-1]  # vLLM shows no text for a stop token id (as the replica does)
            detokenizer.add_tokens(visible)
            finish_reason, stop_reason = completion.finish_reason, completion.stop_reason
            if detokenizer.stop_reason is not None:
                # A stop string the replica could not see: it starts before the seam.
                finish_reason, stop_reason = "stop", detokenizer.stop_reason
            elif finish_reason is not None:
                detokenizer.finish()
            cumulative = completion.cumulative_logprob
            completions.append(
                msgspec.structs.replace(
                    completion,
                    text=detokenizer.text[self._num_chars :],
                    cumulative_logprob=None if cumulative is None else cumulative + self._logprob_offset,
                    finish_reason=finish_reason,
                    stop_reason=stop_reason,
                )
            )
        return msgspec.structs.replace(
            output,
            prompt=first.prompt,
            prompt_token_ids=first.prompt_token_ids,
            outputs=completions,
            finished=output.finished or any(completion.finished() for completion in completions),
            num_cached_tokens=first.num_cached_tokens,
            prompt_logprobs=None,
        )
