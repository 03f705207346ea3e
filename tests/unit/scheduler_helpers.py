"""Drive the scheduler without a model: requests, a fake worker with a shadow KV cache
(the invariants it checks are in tests/unit/scheduler_invariants.py).

`FakeWorker` plays the model runner's part from `SchedulerOutput` alone, as a real worker would: it
keeps each sequence's tokens, block table and computed count from the new-sequence data and the
deltas (`block_table_starts` included; its own sampled tokens appended after each step, the
scheduler's tokens written over them from the first it had not sent, so that a step scheduled
before the previous one's tokens were known computes a position only the worker knows: async
scheduling), applies the step's block moves first (swaps out, swaps in,
then copies, between a shadow device cache and a shadow CPU cache), "writes" every scheduled token
into the shadow device cache, checks that every position a sequence attends to holds that
sequence's own prefix (which catches a prefix-cache hit on a block that was overwritten, a missing
copy-on-write, a swap that went to the wrong block, or a block table that went wrong), and samples
one token for each sequence whose scheduled tokens reach the end of its known tokens.

The "model" is deterministic, a function of the sequence so far (so that recomputation, swapping
and forking cannot change it): `token_fn` picks sampled tokens, and `fake_logprobs` is a fixed
pseudo-random log-softmax over a small vocabulary, used for returned log-probabilities (beam
candidates included) and for the tokens of greedy sequences (beam search samples greedily).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterable
from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass, field
from typing import Any

from engine.config import CacheConfig, SchedulerConfig
from engine.lora.request import LoRARequest
from engine.outputs import (
    EngineCoreOutput,
    EngineCoreOutputs,
    LogprobsLists,
    ModelRunnerOutput,
    SchedulerOutput,
)
from engine.sampling_params import BeamSearchParams, SamplingParams
from engine.sched.request import Request
from engine.sched.scheduler import Scheduler
from tests.unit.scheduler_invariants import check_invariants

# (seq_id, all known tokens of the sequence) -> the token the "model" samples next.
TokenFn = Callable[[str, list[int]], int]

VOCAB = 8  # vocabulary of `fake_logprobs`


def default_token_fn(seq_id: str, tokens: list[int]) -> int:
    """A token that depends only on the sequence so far (so recomputation cannot change it)."""
    return 1000 + len(tokens)


def seq_index(seq_id: str) -> int:
    """A sequence's index within its request, from its id ("r" -> 0, "r#3" -> 3)."""
    return int(seq_id.rpartition("#")[2]) if "#" in seq_id else 0


def indexed_token_fn(seq_id: str, tokens: list[int]) -> int:
    """Like `default_token_fn`, but forks of one request sample different tokens (as seeds would)."""
    return 1000 + 100 * seq_index(seq_id) + len(tokens)


def fake_logprobs(tokens: SequenceOf[int], vocab: int = VOCAB) -> list[float]:
    """A fixed pseudo-random log-softmax over `vocab` tokens, a function of the sequence so far."""
    rng = random.Random(hash(tuple(tokens)))  # tuples of ints hash the same in every process
    logits = [rng.uniform(-4.0, 4.0) for _ in range(vocab)]
    top = max(logits)
    norm = top + math.log(sum(math.exp(x - top) for x in logits))
    return [x - norm for x in logits]


def logprobs_row(
    tokens: SequenceOf[int], sampled: int, num_logprobs: int, vocab: int = VOCAB
) -> LogprobsLists:
    """One position's LogprobsLists as a worker returns it: the sampled token, then the top-k.

    A sampled token outside the small vocabulary borrows the log-probability of `token % vocab`.
    """
    row = fake_logprobs(tokens, vocab)
    ranked = sorted(range(vocab), key=lambda t: row[t], reverse=True)[:num_logprobs]
    chosen = row[sampled % vocab]
    rank = 1 + sum(1 for value in row if value > chosen)
    return LogprobsLists([[sampled, *ranked]], [[chosen, *(row[t] for t in ranked)]], [rank])


def greedy_token(tokens: SequenceOf[int], vocab: int = VOCAB) -> int:
    row = fake_logprobs(tokens, vocab)
    return max(range(vocab), key=lambda t: row[t])


def make_request(
    request_id: str,
    prompt: Iterable[int],
    *,
    max_tokens: int | None = 16,
    eos_token_id: int | None = None,
    priority: int = 0,
    arrival_time: float = 0.0,
    stop_token_ids: list[int] | None = None,
    ignore_eos: bool = False,
    n: int = 1,
    best_of: int | None = None,
    seed: int | None = None,
    logprobs: int | None = None,
    min_tokens: int = 0,
    cache_salt: str | None = None,
    lora_request: LoRARequest | None = None,
) -> Request:
    params = SamplingParams(
        max_tokens=max_tokens,
        min_tokens=min_tokens,
        stop_token_ids=stop_token_ids,
        ignore_eos=ignore_eos,
        n=n,
        best_of=best_of,
        seed=seed,
        logprobs=logprobs,
    )
    return Request(
        request_id,
        list(prompt),
        params,
        eos_token_id,
        arrival_time,
        priority,
        cache_salt=cache_salt,
        lora_request=lora_request,
    )


def make_beam_request(
    request_id: str,
    prompt: Iterable[int],
    *,
    beam_width: int,
    max_tokens: int,
    eos_token_id: int | None = None,
    length_penalty: float = 1.0,
    ignore_eos: bool = False,
    priority: int = 0,
    arrival_time: float = 0.0,
    cache_salt: str | None = None,
) -> Request:
    """A beam search request as the input processor builds it (greedy per-token sampling)."""
    beam = BeamSearchParams(
        beam_width=beam_width, max_tokens=max_tokens, length_penalty=length_penalty, ignore_eos=ignore_eos
    )
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos)
    return Request(request_id, list(prompt), params, eos_token_id, arrival_time, priority, beam, cache_salt)


def make_scheduler(
    *,
    num_blocks: int,
    block_size: int = 4,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 64,
    max_model_len: int = 1024,
    enable_prefix_caching: bool = True,
    num_cpu_blocks: int = 0,
    preemption_mode: str | None = None,
    sliding_window: int | None = None,
    max_loras: int | None = None,
    async_scheduling: bool = False,
) -> Scheduler:
    return Scheduler(
        SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            preemption_mode=preemption_mode,
        ),
        CacheConfig(block_size=block_size, enable_prefix_caching=enable_prefix_caching),
        num_kv_blocks=num_blocks,
        max_model_len=max_model_len,
        num_cpu_blocks=num_cpu_blocks,
        sliding_window=sliding_window,
        max_loras=max_loras,
        async_scheduling=async_scheduling,
    )


def scheduler_and_worker(token_fn: TokenFn = default_token_fn, **kwargs: Any) -> tuple[Scheduler, FakeWorker]:
    """A scheduler (`make_scheduler`'s keywords) and a fake worker that cross-checks it."""
    scheduler = make_scheduler(**kwargs)
    window = scheduler.kv_cache_manager.sliding_window
    return scheduler, FakeWorker(scheduler.block_size, token_fn, scheduler, window=window)


def scripted(script: dict[str, list[int]], prompt_lens: dict[str, int]) -> TokenFn:
    """A token function that plays back a fixed output per request."""
    return lambda seq_id, tokens: script[seq_id][len(tokens) - prompt_lens[seq_id]]


def outputs_by_id(outputs: EngineCoreOutputs) -> dict[str, EngineCoreOutput]:
    return {output.request_id: output for output in outputs.outputs}


def two_growing_requests(
    priority_a: int = 0, priority_b: int = 0
) -> tuple[Scheduler, FakeWorker, Request, Request]:
    """4 blocks of 4 tokens; a and b each take 2 blocks at once and need a third at their 9th token."""
    scheduler, worker = scheduler_and_worker(num_blocks=4)
    a = make_request("a", range(1, 7), max_tokens=8, arrival_time=0.0, priority=priority_a)
    b = make_request("b", range(11, 17), max_tokens=8, arrival_time=1.0, priority=priority_b)
    scheduler.add_request(a)
    scheduler.add_request(b)
    for _ in range(3):  # prefill, then two decodes: both sit at 9 tokens, 8 computed
        out, _ = step(scheduler, worker)
        assert set(out.num_scheduled_tokens) == {"a", "b"}
    assert scheduler.kv_cache_manager.num_free_blocks == 0
    return scheduler, worker, a, b


@dataclass
class _WorkerState:
    tokens: list[int]
    block_ids: list[int]
    num_computed: int
    greedy: bool
    num_logprobs: int | None
    # tokens[:num_known] came from the scheduler; those after it the worker sampled itself.
    num_known: int = 0
    # The scheduler's Sequence it was sent for (a later request may reuse the id while a step of
    # this one is still in flight: async scheduling).
    seq: object | None = None
    # fingerprints[p] identifies tokens[: p + 1]: the KV at position p depends on all of them.
    fingerprints: list[int] = field(default_factory=list)

    def fingerprint(self, position: int) -> int:
        while len(self.fingerprints) <= position:
            index = len(self.fingerprints)
            parent = self.fingerprints[-1] if self.fingerprints else 0
            self.fingerprints.append(hash((parent, self.tokens[index])))
        return self.fingerprints[position]


@dataclass
class FakeWorker:
    """A model runner without a model (see the module docstring)."""

    block_size: int
    token_fn: TokenFn = default_token_fn
    # Optional cross-check: the scheduler's own view must agree with what the deltas say.
    scheduler: Scheduler | None = None
    vocab: int = VOCAB
    # Every layer's sliding window, if all slide: a query sees only that many positions back.
    window: int | None = None
    states: dict[str, _WorkerState] = field(default_factory=dict)
    # block id -> fingerprints of what each of its slots holds (None: never written), per cache.
    device: dict[int, list[int | None]] = field(default_factory=dict)
    cpu: dict[int, list[int | None]] = field(default_factory=dict)

    def _block(self, cache: dict[int, list[int | None]], block_id: int) -> list[int | None]:
        return cache.setdefault(block_id, [None] * self.block_size)

    def _slot(self, state: _WorkerState, position: int) -> tuple[int, int]:
        return state.block_ids[position // self.block_size], position % self.block_size

    def _move(self, pairs: list[tuple[int, int]], source: dict, target: dict, what: str) -> None:
        """Copy whole blocks, all sources read before any target is written (as one kernel).

        A source may repeat (a copy-on-write block copied for several writers, a prefix block two
        swapped requests share), a target may not."""
        sources = [src for src, _ in pairs]
        targets = [dst for _, dst in pairs]
        if source is target:
            assert not set(sources) & set(targets), f"{what}: a block is copied onto a source: {pairs}"
        assert len(set(targets)) == len(targets), f"{what}: a target block is written twice: {pairs}"
        contents = [list(self._block(source, src)) for src in sources]
        for dst, content in zip(targets, contents, strict=True):
            target[dst] = content

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """One step, in a real runner's order: drop, move blocks, take the new data and the deltas,
        write every scheduled token's KV, check what each sequence attends to, sample."""
        for seq_id in out.finished_seq_ids:
            self.states.pop(seq_id, None)
        self._apply_block_moves(out)
        self._add_new_seqs(out)
        self._apply_deltas(out)
        self._check_batch_is_consistent(out)
        # Write the KV of every scheduled token first (all layers write before they attend) ...
        for seq_id, num in out.num_scheduled_tokens.items():
            self._write_kv(seq_id, num)
        # ... then check that every position each sequence attends to holds its own prefix.
        seq_ids, sampled, logprobs = [], [], []
        for seq_id, num in out.num_scheduled_tokens.items():
            state = self.states[seq_id]
            end = state.num_computed + num
            self._check_attended_kv(seq_id, self._first_visible(state.num_computed), end)
            state.num_computed = end
            reaches_end = end == len(state.tokens)
            self._cross_check(seq_id, state, reaches_end)
            if reaches_end:
                token, row = self._sample(seq_id, state)
                state.tokens.append(token)  # the next step's input, if it runs before the scheduler knows it
                seq_ids.append(seq_id)
                sampled.append([token])
                logprobs.append(row)
        if all(row is None for row in logprobs):
            logprobs = []  # as a real runner: no list at all when no sequence asked for any
        return ModelRunnerOutput(seq_ids=seq_ids, sampled_token_ids=sampled, logprobs=logprobs)

    def _apply_block_moves(self, out: SchedulerOutput) -> None:
        """The block moves come before the forward pass, in this order."""
        self._move(out.blocks_to_swap_out, self.device, self.cpu, "swap out")
        self._move(out.blocks_to_swap_in, self.cpu, self.device, "swap in")
        self._move(out.blocks_to_copy, self.device, self.device, "copy")

    def _add_new_seqs(self, out: SchedulerOutput) -> None:
        for new in out.scheduled_new_seqs:
            assert new.seq_id not in self.states, f"{new.seq_id} sent as new while the worker holds it"
            self.states[new.seq_id] = _WorkerState(
                tokens=list(new.prompt_token_ids) + list(new.output_token_ids),
                block_ids=list(new.block_ids),
                num_computed=new.num_computed_tokens,
                greedy=new.sampling_params.is_greedy,
                num_logprobs=new.num_logprobs,
                num_known=len(new.prompt_token_ids) + len(new.output_token_ids),
                seq=None if self.scheduler is None else self.scheduler.groups.seqs.get(new.seq_id),
            )

    def _apply_deltas(self, out: SchedulerOutput) -> None:
        deltas = out.scheduled_cached_seqs
        for seq_id, new_tokens, start, new_blocks, num_computed in zip(
            deltas.seq_ids,
            deltas.new_token_ids,
            deltas.block_table_starts,
            deltas.new_block_ids,
            deltas.num_computed_tokens,
            strict=True,
        ):
            state = self.states[seq_id]
            assert state.num_computed == num_computed, (seq_id, state.num_computed, num_computed)
            assert 0 <= start <= len(state.block_ids), (seq_id, start, state.block_ids)
            self._add_known_tokens(seq_id, state, new_tokens)
            state.block_ids[start:] = new_blocks

    @staticmethod
    def _add_known_tokens(seq_id: str, state: _WorkerState, new_tokens: list[int]) -> None:
        """The scheduler's tokens after those it sent before, written over the worker's own samples
        (as `WorkerSequenceState.add_known_tokens`). A position already computed must keep its value
        (its KV was written from it); one not computed yet may change (beam search picks its tokens)."""
        start = state.num_known
        for offset, token in enumerate(new_tokens):
            position = start + offset
            if position < len(state.tokens) and state.tokens[position] != token:
                assert position >= state.num_computed, (
                    f"{seq_id}: position {position} was computed on token {state.tokens[position]}, "
                    f"the scheduler says {token}"
                )
                del state.fingerprints[position:]
        state.tokens[start : start + len(new_tokens)] = new_tokens
        state.num_known += len(new_tokens)

    @staticmethod
    def _check_batch_is_consistent(out: SchedulerOutput) -> None:
        """Each scheduled sequence is sent once, as new data or deltas, and the counts add up."""
        scheduled_ids = [new.seq_id for new in out.scheduled_new_seqs] + list(
            out.scheduled_cached_seqs.seq_ids
        )
        assert len(scheduled_ids) == len(set(scheduled_ids)), f"a sequence sent twice: {scheduled_ids}"
        assert sorted(scheduled_ids) == sorted(out.num_scheduled_tokens), "scheduled ids disagree"
        assert out.total_num_scheduled_tokens == sum(out.num_scheduled_tokens.values())

    def _write_kv(self, seq_id: str, num: int) -> None:
        state = self.states[seq_id]
        end = state.num_computed + num
        assert num >= 1 and end <= len(state.tokens), (seq_id, state.num_computed, num, len(state.tokens))
        assert len(state.block_ids) * self.block_size >= end, f"{seq_id}: too few blocks for {end} tokens"
        for position in range(state.num_computed, end):
            block_id, offset = self._slot(state, position)
            self._block(self.device, block_id)[offset] = state.fingerprint(position)

    def _first_visible(self, position: int) -> int:
        """The first position a query at `position` attends to."""
        return 0 if self.window is None else max(position - self.window + 1, 0)

    def _check_attended_kv(self, seq_id: str, start: int, end: int) -> None:
        state = self.states[seq_id]
        for position in range(start, end):
            block_id, offset = self._slot(state, position)
            assert self._block(self.device, block_id)[offset] == state.fingerprint(position), (
                f"{seq_id}: KV at position {position} (block {block_id}, slot {offset}) is stale"
            )

    def _sample(self, seq_id: str, state: _WorkerState) -> tuple[int, LogprobsLists | None]:
        """The next token and its log-probabilities, if asked for (the caller keeps the token, as a
        real runner does, until the scheduler's delta writes its own over it)."""
        tokens = list(state.tokens)
        token = greedy_token(tokens, self.vocab) if state.greedy else self.token_fn(seq_id, tokens)
        row = (
            None
            if state.num_logprobs is None
            else logprobs_row(tokens, token, state.num_logprobs, self.vocab)
        )
        return token, row

    def _cross_check(self, seq_id: str, state: _WorkerState, reaches_end: bool) -> None:
        scheduler = self.scheduler
        seq = None if scheduler is None else scheduler.groups.seqs.get(seq_id)
        if seq is None or seq is not state.seq:
            return
        if scheduler.async_scheduling:
            # The scheduler may have planned the next step already, and not know this one's inputs
            # yet: where both know a token, it is the same.
            common = min(seq.num_tokens, len(state.tokens))
            assert seq.all_token_ids[:common] == state.tokens[:common], f"{seq_id}: worker tokens diverged"
            return
        assert seq.all_token_ids == state.tokens, f"{seq_id}: worker tokens diverged"
        assert seq.num_computed_tokens == state.num_computed
        # Entries before the window may have been freed: the scheduler's point at its null block,
        # the worker's keep their old ids; neither is read.
        first_block = self._first_visible(state.num_computed) // self.block_size
        scheduler_ids = scheduler.kv_cache_manager.block_ids(seq_id)
        assert scheduler_ids[first_block:] == state.block_ids[first_block:], f"{seq_id}: block tables"
        assert (seq.num_computed_tokens == seq.num_tokens) == reaches_end


def step(
    scheduler: Scheduler, worker: FakeWorker, check: bool = True
) -> tuple[SchedulerOutput, EngineCoreOutputs]:
    """One engine step: schedule, run the fake worker, update; invariants checked after each half.

    As EngineCore.step does, the outputs of requests that scheduling finished come first.
    """
    scheduled = scheduler.schedule()
    out = scheduled.scheduler_output
    if check:
        check_invariants(scheduler)
        assert out.total_num_scheduled_tokens <= scheduler.max_num_batched_tokens
        assert len(out.num_scheduled_tokens) <= scheduler.max_num_seqs
    runner_output = worker.execute(out)
    outputs = scheduler.update_from_output(out, runner_output)
    outputs.outputs = scheduled.finished_outputs + outputs.outputs
    if check:
        check_invariants(scheduler)
    return out, outputs


def output_key(output: EngineCoreOutput) -> str:
    """Where `collect` files an output: the request id for index 0, "id#index" for the others."""
    return f"{output.request_id}#{output.index}" if output.index else output.request_id


def run_until_done(
    scheduler: Scheduler, worker: FakeWorker, max_steps: int = 500
) -> tuple[dict[str, list[int]], dict[str, object]]:
    """Step until nothing is left; the emitted tokens and the finish reason per sequence (`output_key`)."""
    tokens: dict[str, list[int]] = {}
    reasons: dict[str, object] = {}
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests():
            return tokens, reasons
        _, outputs = step(scheduler, worker)
        collect(outputs, tokens, reasons)
    raise AssertionError(f"not done after {max_steps} steps: {scheduler.running} {scheduler.waiting}")


def collect(outputs: EngineCoreOutputs, tokens: dict[str, list[int]], reasons: dict[str, object]) -> None:
    for output in outputs.outputs:
        key = output_key(output)
        assert key not in reasons, f"{key} reported after it finished"
        tokens.setdefault(key, []).extend(output.new_token_ids)
        if output.finished:
            reasons[key] = output.finish_reason


def indexed_scheduler_and_worker(**kwargs):
    """A scheduler and a fake worker sampling `indexed_token_fn`, for requests of several sequences."""
    return scheduler_and_worker(indexed_token_fn, **kwargs)


def outputs_by_key(outputs):
    """A step's outputs by (request id, sequence index)."""
    return {(o.request_id, o.index): o for o in outputs.outputs}


def block_ref_counts(scheduler) -> list[int]:
    """The reference count of every device block, by block id."""
    return [block.ref_cnt for block in scheduler.kv_cache_manager.block_pool.blocks]
