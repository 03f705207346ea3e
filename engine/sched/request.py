"""Requests as the scheduler sees them: a group of sequences that share a prompt (and KV blocks).

A plain request has one sequence. Parallel sampling (n, best_of) forks the prompt's sequence into
several once the prompt is in the cache; beam search forks and frees sequences every step. The
scheduler schedules whole requests; the workers only ever see sequences, by `seq_id`.
"""

from __future__ import annotations

import enum

from engine.lora.request import LoRARequest, prefix_cache_salt
from engine.outputs import EngineCoreOutput, EngineCoreRequest, FinishReason, LogprobsLists
from engine.sampling_params import BeamSearchParams, SamplingParams
from engine.sched.beam_search import Hypothesis
from engine.sched.grammar import GrammarMatcher, PendingGrammar
from engine.sched.spec_backoff import SpecBackoff


class RequestStatus(enum.IntEnum):
    """Lifecycle of a request: the scheduler queue it sits in, then how it ended (every status
    after SWAPPED is final). Its sequences have their own `SequenceStatus`."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    SWAPPED = 3
    FINISHED_STOPPED = 4
    FINISHED_LENGTH_CAPPED = 5
    FINISHED_ABORTED = 6
    FINISHED_IGNORED = 7

    @property
    def is_finished(self) -> bool:
        return self > RequestStatus.SWAPPED

    @property
    def sequence_status(self) -> SequenceStatus:
        """The status a request's live sequences take when the request takes this one."""
        return SequenceStatus(int(self))


class SequenceStatus(enum.IntEnum):
    """Lifecycle of one sequence: it follows its request through the queues, but may finish on its
    own (a stop, its length, pruned from a beam search) while the others of the request go on."""

    WAITING = RequestStatus.WAITING
    RUNNING = RequestStatus.RUNNING
    PREEMPTED = RequestStatus.PREEMPTED
    SWAPPED = RequestStatus.SWAPPED
    FINISHED_STOPPED = RequestStatus.FINISHED_STOPPED
    FINISHED_LENGTH_CAPPED = RequestStatus.FINISHED_LENGTH_CAPPED
    FINISHED_ABORTED = RequestStatus.FINISHED_ABORTED
    FINISHED_IGNORED = RequestStatus.FINISHED_IGNORED
    # A beam search sequence dropped because better beams took its place; never reported.
    FINISHED_PRUNED = 8

    @property
    def is_finished(self) -> bool:
        return self > SequenceStatus.SWAPPED

    @property
    def finish_reason(self) -> FinishReason | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    SequenceStatus.FINISHED_STOPPED: FinishReason.STOP,
    SequenceStatus.FINISHED_LENGTH_CAPPED: FinishReason.LENGTH,
    SequenceStatus.FINISHED_ABORTED: FinishReason.ABORT,
    # vLLM reports a prompt it could never schedule as cut short by length.
    SequenceStatus.FINISHED_IGNORED: FinishReason.LENGTH,
}


class Sequence:
    """One token sequence: the shared prompt plus its own outputs, and how much of it is cached.

    `num_computed_tokens` counts the tokens whose keys and values are in the KV cache (or are being
    computed by the step in flight); scheduling is making it catch up with `num_tokens`.
    """

    def __init__(self, request: Request, index: int, output_token_ids: list[int] | None = None) -> None:
        self.request = request
        self.index = index
        self.seq_id = f"{request.request_id}#{index}" if index else request.request_id
        self.output_token_ids: list[int] = list(output_token_ids or [])
        self.all_token_ids: list[int] = [*request.prompt_token_ids, *self.output_token_ids]
        self.num_computed_tokens = 0
        # Tokens it samples in steps still in flight (async scheduling): the steps scheduled after
        # them compute these placeholders, whose values the workers fill in from their own samples.
        self.num_pending_tokens = 0
        self.status = SequenceStatus.WAITING
        self.stop_reason: int | str | None = None
        self.cumulative_logprob = 0.0
        # The sequence's place in its request's grammar (structured outputs); set once it is compiled.
        self.grammar: GrammarMatcher | None = None
        # Speculative drafts for the token after the next one on, and how often to propose them
        # (engine/sched/speculation.py).
        self.spec_token_ids: list[int] = []
        self.spec_backoff = SpecBackoff()

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.request.prompt_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def pending_reach_limit(self, max_seq_len: int) -> bool:
        """Whether the tokens in flight already take it to its length limit or max_tokens: the last
        of them may be its last, so nothing is scheduled after it until it is known."""
        if not self.num_pending_tokens:
            return False
        max_tokens = self.request.sampling_params.max_tokens
        return self.num_tokens + self.num_pending_tokens >= max_seq_len or (
            max_tokens is not None and self.num_output_tokens + self.num_pending_tokens >= max_tokens
        )

    def append_output_token(self, token_id: int, logprob: float | None = None) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        if logprob is not None:
            self.cumulative_logprob += logprob
        if self.grammar is not None:
            self.grammar.accept_token(token_id)

    def check_stop(self, max_seq_len: int) -> SequenceStatus | None:
        """How the sequence ends after its latest token, if it does (vLLM's order of checks)."""
        request = self.request
        params = request.sampling_params
        at_length_limit = self.num_tokens >= max_seq_len
        # A complete grammar ends the sequence whatever else holds: nothing more may be generated.
        grammar_end = self._grammar_end()
        if self.num_output_tokens < params.min_tokens:
            # min_tokens holds back every other stop but the hard length limit.
            return grammar_end or (SequenceStatus.FINISHED_LENGTH_CAPPED if at_length_limit else None)
        token_id = self.output_token_ids[-1]
        if token_id == request.eos_token_id and not params.ignore_eos:
            return SequenceStatus.FINISHED_STOPPED
        if token_id in params.all_stop_token_ids:
            self.stop_reason = token_id
            return SequenceStatus.FINISHED_STOPPED
        if grammar_end is not None:
            return grammar_end
        # An EOS or stop token on the last position still counts as a stop.
        if at_length_limit or (params.max_tokens is not None and self.num_output_tokens >= params.max_tokens):
            return SequenceStatus.FINISHED_LENGTH_CAPPED
        return None

    def _grammar_end(self) -> SequenceStatus | None:
        """Stopped where the grammar is complete; aborted, with the request's error set, where the
        grammar library failed (a limit it hit), since the output could no longer be held to it."""
        if self.grammar is None or not self.grammar.is_terminated():
            return None
        error = self.grammar.error()
        if error:
            self.request.error = f"structured output: the grammar could not go on: {error}"
            return SequenceStatus.FINISHED_ABORTED
        return SequenceStatus.FINISHED_STOPPED

    def make_output(
        self,
        new_token_ids: list[int],
        new_logprobs: LogprobsLists | None = None,
        prompt_logprobs: LogprobsLists | None = None,
    ) -> EngineCoreOutput:
        """This step's news about the sequence, for the front end."""
        request = self.request
        return EngineCoreOutput(
            request_id=request.request_id,
            index=self.index,
            new_token_ids=new_token_ids,
            new_logprobs=new_logprobs,
            prompt_logprobs=prompt_logprobs,
            finish_reason=self.status.finish_reason,
            stop_reason=self.stop_reason,
            num_cached_tokens=max(request.num_cached_tokens, 0),
            cumulative_logprob=self.cumulative_logprob if new_logprobs is not None else None,
            error=request.error,
        )

    def fork(self, index: int) -> Sequence:
        """A copy with its own index and id; KV blocks are shared by the cache manager, not here."""
        child = Sequence(self.request, index, self.output_token_ids)
        child.num_computed_tokens = self.num_computed_tokens
        child.status = self.status
        child.cumulative_logprob = self.cumulative_logprob
        child.grammar = self.grammar.fork() if self.grammar is not None else None
        return child

    def __repr__(self) -> str:
        return f"Sequence({self.seq_id!r}, {self.status.name}, tokens={self.num_computed_tokens}/{self.num_tokens})"


class Request:
    """Scheduler-side state of one request: its settings and its live and finished sequences."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_id: int | None,
        arrival_time: float,
        priority: int = 0,
        beam_search: BeamSearchParams | None = None,
        cache_salt: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.sampling_params = sampling_params
        self.beam_search = beam_search
        self.lora_request = lora_request
        # Salts the hash of the first KV block: only requests with the same salt and adapter share
        # cached blocks.
        self.cache_salt = prefix_cache_salt(cache_salt, lora_request)
        self.eos_token_id = eos_token_id
        self.arrival_time = arrival_time
        self.priority = priority
        self.status = RequestStatus.WAITING
        self.seqs: list[Sequence] = [Sequence(self, 0)]
        # Sequences to fork from the first once the prompt (but its last token) is cached.
        self.num_pending_forks = 0 if beam_search else sampling_params.num_sequences - 1
        self.next_seq_index = 1
        # Tokens found in the prefix cache at first admission (reported to the user).
        self.num_cached_tokens = -1
        self.num_preemptions = 0
        self.error: str | None = None
        # The request's grammar while it compiles, and after (structured outputs); None without one.
        self.grammar: PendingGrammar | None = None

    @classmethod
    def from_engine_core_request(cls, request: EngineCoreRequest) -> Request:
        return cls(
            request.request_id,
            request.prompt_token_ids,
            request.sampling_params,
            request.eos_token_id,
            request.arrival_time,
            request.priority,
            request.beam_search,
            request.cache_salt,
            request.lora_request,
        )

    @property
    def live_seqs(self) -> list[Sequence]:
        return [seq for seq in self.seqs if not seq.is_finished]

    @property
    def waits_for_grammar(self) -> bool:
        """Its grammar is still being compiled: it cannot be scheduled yet (others may go first)."""
        return self.grammar is not None and not self.grammar.done()

    def start_grammar(self) -> str | None:
        """Give the first sequence its matcher once the grammar is compiled (before it samples, and
        before forks copy it); the error if the grammar could not be compiled."""
        first = self.seqs[0]
        if self.grammar is None or first.grammar is not None:
            return None
        error = self.grammar.exception()
        if error is not None:
            return f"structured output: the grammar could not be compiled: {error}"
        first.grammar = self.grammar.result().new_matcher()
        return None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def max_concurrent_seqs(self) -> int:
        """Most sequences this request will ever run at once (its rows of the engine's max_num_seqs)."""
        return self.beam_search.beam_width if self.beam_search else self.sampling_params.num_sequences

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def sort_key(self) -> tuple[int, float]:
        """Lower runs first: priority, then arrival (FCFS)."""
        return (self.priority, self.arrival_time)

    def target_num_tokens(self, seq: Sequence) -> int:
        """How far `seq` may compute now: all its tokens and placeholders, except that a request
        still to be forked stops before the prompt's last token, which every fork computes (and
        samples from) itself."""
        if self.num_pending_forks:
            return self.num_prompt_tokens - 1
        return seq.num_tokens + seq.num_pending_tokens

    @property
    def runs_on_placeholders(self) -> bool:
        """Whether its next step may be scheduled before its tokens are known (async scheduling):
        not beam search (the scheduler picks the tokens) nor a grammar (the next mask needs them)."""
        return self.beam_search is None and self.grammar is None

    def beam_outputs(self, hypotheses: list[Hypothesis]) -> list[EngineCoreOutput]:
        """The final beams, best first, each reported once with all its tokens."""
        return [
            EngineCoreOutput(
                request_id=self.request_id,
                index=index,
                new_token_ids=hypothesis.token_ids,
                finish_reason=FinishReason.STOP if hypothesis.ended_by_eos else FinishReason.LENGTH,
                num_cached_tokens=max(self.num_cached_tokens, 0),
                cumulative_logprob=hypothesis.cumulative_logprob,
            )
            for index, hypothesis in enumerate(hypotheses)
        ]

    def new_seq_index(self) -> int:
        index = self.next_seq_index
        self.next_seq_index += 1
        return index

    def __repr__(self) -> str:
        return f"Request({self.request_id!r}, {self.status.name}, seqs={self.seqs})"
