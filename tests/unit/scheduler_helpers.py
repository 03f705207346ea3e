"""Drive the scheduler without a model: requests, a fake worker with a shadow KV cache, invariants.

`FakeWorker` plays the model runner's part from `SchedulerOutput` alone, as a real worker would: it
keeps each sequence's tokens, block table and computed count from the new-sequence data and the
deltas (`block_table_starts` included), applies the step's block moves first (swaps out, swaps in,
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

import itertools
import math
import random
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable
from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass, field
from typing import Any

from engine.block_pool import BlockPool, KVCacheBlock
from engine.config import CacheConfig, SchedulerConfig
from engine.outputs import (
    EngineCoreOutput,
    EngineCoreOutputs,
    LogprobsLists,
    ModelRunnerOutput,
    SchedulerOutput,
)
from engine.request import Request, RequestStatus, Sequence
from engine.sampling_params import BeamSearchParams, SamplingParams
from engine.scheduler import Scheduler

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
    return Request(request_id, list(prompt), params, eos_token_id, arrival_time, priority)


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
) -> Request:
    """A beam search request as the input processor builds it (greedy per-token sampling)."""
    beam = BeamSearchParams(
        beam_width=beam_width, max_tokens=max_tokens, length_penalty=length_penalty, ignore_eos=ignore_eos
    )
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos)
    return Request(request_id, list(prompt), params, eos_token_id, arrival_time, priority, beam)


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
    )


def scheduler_and_worker(token_fn: TokenFn = default_token_fn, **kwargs: Any) -> tuple[Scheduler, FakeWorker]:
    """A scheduler (`make_scheduler`'s keywords) and a fake worker that cross-checks it."""
    scheduler = make_scheduler(**kwargs)
    return scheduler, FakeWorker(scheduler.block_size, token_fn, scheduler)


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
            self._check_attended_kv(seq_id, end)
            state.num_computed = end
            reaches_end = end == len(state.tokens)
            self._cross_check(seq_id, state, reaches_end)
            if reaches_end:
                token, row = self._sample(seq_id, state)
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
            state.tokens.extend(new_tokens)
            state.block_ids[start:] = new_blocks

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

    def _check_attended_kv(self, seq_id: str, end: int) -> None:
        state = self.states[seq_id]
        for position in range(end):
            block_id, offset = self._slot(state, position)
            assert self._block(self.device, block_id)[offset] == state.fingerprint(position), (
                f"{seq_id}: KV at position {position} (block {block_id}, slot {offset}) is stale"
            )

    def _sample(self, seq_id: str, state: _WorkerState) -> tuple[int, LogprobsLists | None]:
        """The next token and its log-probabilities, if asked for. Like a real runner, the worker
        learns its own sampled token from the next delta."""
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
        if scheduler is None or seq_id not in scheduler.groups.seqs:
            return
        seq = scheduler.groups.seqs[seq_id]
        assert seq.all_token_ids == state.tokens, f"{seq_id}: worker tokens diverged"
        assert seq.num_computed_tokens == state.num_computed
        assert scheduler.kv_cache_manager.block_ids(seq_id) == state.block_ids, f"{seq_id}: block tables"
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


def held_blocks(scheduler: Scheduler) -> dict[str, list[int]]:
    """Device block ids each sequence holds (sequences holding none left out)."""
    kv = scheduler.kv_cache_manager
    return {seq_id: [b.block_id for b in blocks] for seq_id, blocks in kv.seq_block_tables.items() if blocks}


def swapped_blocks(scheduler: Scheduler) -> dict[str, list[int]]:
    """CPU block ids each swapped-out sequence holds."""
    kv = scheduler.kv_cache_manager
    return {seq_id: [b.block_id for b in blocks] for seq_id, blocks in kv.swapped_blocks.items() if blocks}


# ---- invariants: each rule a named predicate, so that a failure says which rule broke ----------


def assert_ref_counts_match_holders(
    pool: BlockPool, tables: dict[str, list[KVCacheBlock]], name: str
) -> None:
    """Every block's reference count is the number of block tables holding it, each at most once."""
    holders: Counter[int] = Counter()
    for seq_id, blocks in tables.items():
        ids = [b.block_id for b in blocks]
        assert len(ids) == len(set(ids)), f"{seq_id} holds a {name} block twice: {ids}"
        assert all(pool.blocks[b.block_id] is b for b in blocks), f"{seq_id} holds a foreign {name} block"
        holders.update(ids)
    for block in pool.blocks:
        assert block.ref_cnt == holders[block.block_id], (
            f"{name} {block}: reference count is not its {holders[block.block_id]} holders"
        )


def assert_free_queue_is_the_unheld_blocks(pool: BlockPool, name: str) -> None:
    """The free queue links exactly the blocks nobody holds, once each, and no held block."""
    queue = list(pool.free_queue)
    queue_ids = [b.block_id for b in queue]
    assert len(queue_ids) == len(set(queue_ids)), f"{name} free queue holds a block twice: {queue_ids}"
    assert set(queue_ids) == {b.block_id for b in pool.blocks if b.ref_cnt == 0}, (
        f"{name} free queue is not the unreferenced blocks"
    )
    assert pool.num_free_blocks == len(queue_ids) == sum(1 for b in pool.blocks if b.ref_cnt == 0), (
        f"{name} free-block count disagrees with the queue"
    )
    for prev, nxt in itertools.pairwise(queue):
        assert prev.next_free is nxt and nxt.prev_free is prev, f"{name} free queue links are broken"
    for block in pool.blocks:
        if block.ref_cnt > 0:
            assert block.prev_free is None and block.next_free is None, f"{name} {block} held but linked"


def assert_prefix_map_matches_block_hashes(pool: BlockPool, name: str) -> None:
    """The hash -> block map holds exactly the blocks that carry a hash, under that hash."""
    for block_hash, block in pool.cached_blocks.items():
        assert block.block_hash == block_hash, f"{name} {block} published under another hash"
    assert sum(1 for b in pool.blocks if b.block_hash is not None) == len(pool.cached_blocks), (
        f"{name} blocks with a hash are not the published ones"
    )


def assert_pool_consistent(pool: BlockPool, tables: dict[str, list[KVCacheBlock]], name: str) -> None:
    assert_ref_counts_match_holders(pool, tables, name)
    assert_free_queue_is_the_unheld_blocks(pool, name)
    assert_prefix_map_matches_block_hashes(pool, name)


def assert_cpu_pool_consistent(scheduler: Scheduler) -> None:
    """The CPU pool keeps the swapped tables' counts and never caches a prefix; without one, nothing
    is swapped out."""
    kv = scheduler.kv_cache_manager
    if kv.cpu_pool is None:
        assert not any(kv.swapped_blocks.values()), "blocks swapped out without a CPU pool"
        return
    assert_pool_consistent(kv.cpu_pool, kv.swapped_blocks, "cpu")
    assert all(b.block_hash is None for b in kv.cpu_pool.blocks) and not kv.cpu_pool.cached_blocks, (
        "the CPU pool caches a prefix"
    )


def assert_shared_blocks_hold_one_prefix(
    tables: dict[str, list[int]], seqs: dict[str, Sequence], block_size: int
) -> None:
    """A block in several tables sits at one position, holding the same tokens for every holder:
    a full block of equal prefixes (prefix cache, forks), or a fork's partial block that no holder
    has written past the fork (the first writer copies it)."""
    where: dict[int, list[tuple[str, int]]] = defaultdict(list)
    for seq_id, table in tables.items():
        for index, block_id in enumerate(table):
            where[block_id].append((seq_id, index))
    for block_id, places in where.items():
        if len(places) < 2:
            continue
        indices = {index for _, index in places}
        assert len(indices) == 1, f"block {block_id} at different positions: {places}"
        (index,) = indices
        start = index * block_size
        fills = {min(seqs[seq_id].num_computed_tokens, start + block_size) - start for seq_id, _ in places}
        assert len(fills) == 1, f"block {block_id} filled differently by its holders: {places}"
        (fill,) = fills
        prefixes = {tuple(seqs[seq_id].all_token_ids[: start + fill]) for seq_id, _ in places}
        assert len(prefixes) == 1, f"block {block_id} shared by different prefixes: {places}"
        if fill < block_size:
            requests = {seqs[seq_id].request_id for seq_id, _ in places}
            assert len(requests) == 1, f"partial block {block_id} shared across requests: {places}"


def _queues(scheduler: Scheduler) -> dict[str, list[Request]]:
    return {"running": scheduler.running, "waiting": scheduler.waiting, "swapped": scheduler.swapped}


def assert_each_request_in_one_queue(scheduler: Scheduler) -> None:
    """The queues are disjoint and hold exactly the scheduler's live requests."""
    queues = _queues(scheduler)
    ids = [r.request_id for queue in queues.values() for r in queue]
    assert len(ids) == len(set(ids)), f"a request in two queues (or twice): {queues}"
    assert sorted(ids) == sorted(scheduler.requests), "the queues are not the live requests"
    assert all(scheduler.requests[r.request_id] is r for r in itertools.chain(*queues.values())), (
        "a queue holds a stale request object"
    )


def assert_queues_in_priority_order(scheduler: Scheduler) -> None:
    for name in ("waiting", "swapped"):
        keys = [r.sort_key for r in _queues(scheduler)[name]]
        assert keys == sorted(keys), f"{name} queue out of priority / FCFS order"


def assert_rows_within_max_num_seqs(scheduler: Scheduler) -> None:
    rows = sum(r.max_concurrent_seqs for r in scheduler.running)
    assert rows <= scheduler.max_num_seqs, f"running requests take {rows} rows, over max_num_seqs"


def assert_seq_registry_is_the_live_seqs(scheduler: Scheduler) -> dict[str, Sequence]:
    """The scheduler's seq_id -> Sequence map holds exactly the live sequences; returns them."""
    live = {seq.seq_id: seq for r in scheduler.requests.values() for seq in r.live_seqs}
    seqs = scheduler.groups.seqs
    assert seqs.keys() == live.keys() and all(seqs[k] is v for k, v in live.items()), (
        "the sequence registry is not the live sequences"
    )
    return live


_QUEUE_REQUEST_STATUSES = {
    "running": {RequestStatus.RUNNING},
    "waiting": {RequestStatus.WAITING, RequestStatus.PREEMPTED},
    "swapped": {RequestStatus.SWAPPED},
}


def assert_group_well_formed(queue: str, request: Request, tables: _BlockTables) -> None:
    """A queued request's status fits its queue, it has 1 to max_concurrent_seqs live sequences
    with distinct indices, forks only after its prompt is cached, and finished sequences hold no block."""
    assert request.status in _QUEUE_REQUEST_STATUSES[queue], f"{request} in the {queue} queue"
    assert 1 <= len(request.live_seqs) <= request.max_concurrent_seqs, f"{request}: live sequence count"
    assert len({seq.index for seq in request.seqs}) == len(request.seqs), f"{request}: repeated index"
    if request.num_pending_forks:
        assert len(request.seqs) == 1, f"{request} forked before its prompt was cached"
    for seq in request.seqs:
        if seq.is_finished:
            assert seq.seq_id not in tables.device and seq.seq_id not in tables.cpu, (
                f"finished {seq} holds blocks"
            )


def assert_seq_within_limits(queue: str, seq: Sequence, scheduler: Scheduler) -> None:
    """A live sequence's status follows its request's queue; it computes no further than its target
    and holds no more tokens than max_seq_len."""
    request = seq.request
    expected = {status.sequence_status for status in _QUEUE_REQUEST_STATUSES[queue]}
    assert seq.status in expected, f"{seq} in the {queue} queue"
    assert seq.num_computed_tokens <= request.target_num_tokens(seq), f"{seq} computed past its target"
    if queue != "waiting" or seq.num_output_tokens:  # (a new prompt may be too long: ignored)
        assert seq.num_tokens <= scheduler.max_seq_len, f"{seq} longer than max_seq_len"


def assert_seq_blocks_fit_queue(
    queue: str, seq: Sequence, scheduler: Scheduler, tables: _BlockTables
) -> None:
    """A running sequence holds exactly the device blocks its computed tokens need (full ones only
    published), a swapped one as many CPU blocks, and a waiting one none and no computed tokens."""
    kv = scheduler.kv_cache_manager
    block_size = scheduler.block_size
    num_blocks = -(-seq.num_computed_tokens // block_size)
    device, cpu = tables.device.get(seq.seq_id), tables.cpu.get(seq.seq_id)
    if queue == "running":
        assert len(device or []) == num_blocks, f"running {seq} holds blocks {device}"
        assert cpu is None, f"running {seq} holds CPU blocks"
        for index, block in enumerate(kv.seq_block_tables[seq.seq_id]):
            if seq.num_computed_tokens < (index + 1) * block_size:
                assert block.block_hash is None, f"{seq}: partial block {block} published"
    elif queue == "swapped":
        assert len(cpu or []) == num_blocks, f"swapped {seq} holds CPU blocks {cpu}"
        assert device is None, f"swapped {seq} holds device blocks"
    else:
        assert seq.num_computed_tokens == 0, f"waiting {seq} has computed tokens"
        assert device is None and cpu is None, f"waiting {seq} holds blocks"


def assert_only_running_seqs_hold_device_blocks(scheduler: Scheduler, tables: _BlockTables) -> None:
    running = {seq.seq_id for r in scheduler.running for seq in r.live_seqs}
    swapped = {seq.seq_id for r in scheduler.swapped for seq in r.live_seqs}
    assert set(tables.device) <= running, "a sequence that is not running holds device blocks"
    assert set(tables.cpu) <= swapped, "a sequence that is not swapped out holds CPU blocks"


@dataclass
class _BlockTables:
    """Block ids each sequence holds, on the device and in the CPU pool (holders of none left out)."""

    device: dict[str, list[int]]
    cpu: dict[str, list[int]]

    @classmethod
    def of(cls, scheduler: Scheduler) -> _BlockTables:
        return cls(held_blocks(scheduler), swapped_blocks(scheduler))


def check_invariants(scheduler: Scheduler) -> None:
    """Pool and scheduler invariants that hold between any two calls into the scheduler."""
    kv = scheduler.kv_cache_manager
    assert_pool_consistent(kv.block_pool, kv.seq_block_tables, "device")
    assert_cpu_pool_consistent(scheduler)
    assert_each_request_in_one_queue(scheduler)
    assert_queues_in_priority_order(scheduler)
    assert_rows_within_max_num_seqs(scheduler)
    live = assert_seq_registry_is_the_live_seqs(scheduler)
    tables = _BlockTables.of(scheduler)
    for queue, requests in _queues(scheduler).items():
        for request in requests:
            assert_group_well_formed(queue, request, tables)
            for seq in request.live_seqs:
                assert_seq_within_limits(queue, seq, scheduler)
                assert_seq_blocks_fit_queue(queue, seq, scheduler, tables)
    assert_only_running_seqs_hold_device_blocks(scheduler, tables)
    assert_shared_blocks_hold_one_prefix(tables.device, live, scheduler.block_size)
    assert_shared_blocks_hold_one_prefix(tables.cpu, live, scheduler.block_size)


def assert_all_free(scheduler: Scheduler) -> None:
    """Nothing left: every device and CPU block back in its free queue, no state kept anywhere."""
    kv = scheduler.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks
    assert not held_blocks(scheduler) and not swapped_blocks(scheduler)
    assert all(block.ref_cnt == 0 for block in kv.block_pool.blocks)
    if kv.cpu_pool is not None:
        assert kv.cpu_pool.num_free_blocks == kv.cpu_pool.num_blocks
        assert all(block.ref_cnt == 0 for block in kv.cpu_pool.blocks)
    assert not scheduler.running and not scheduler.waiting and not scheduler.swapped
    assert not scheduler.requests and not scheduler.groups.seqs and not scheduler.groups.beam_states
    # No per-sequence bookkeeping outlives its sequence.
    assert not kv.num_cached_blocks and not any(kv.seq_block_hashes.values())
    assert not scheduler.worker_sequences.num_tokens_sent and not scheduler.groups.beam_candidates
    check_invariants(scheduler)
