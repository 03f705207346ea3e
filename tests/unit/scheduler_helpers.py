"""Drive the scheduler without a model: requests, a fake worker with a shadow KV cache, invariants.

`FakeWorker` plays the model runner's part from `SchedulerOutput` alone, as a real worker would: it
keeps each request's tokens, block table and computed count from the new-request data and the
deltas, "writes" every scheduled token into a shadow KV cache, checks that every position a request
attends to holds that request's own prefix (which catches a prefix-cache hit on a block that was
overwritten, or a block table that went wrong), and samples one token for each request whose
scheduled tokens reach the end of its known tokens.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from engine.config import CacheConfig, SchedulerConfig
from engine.outputs import EngineCoreOutputs, ModelRunnerOutput, SchedulerOutput
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler

# (request_id, all known tokens of the request) -> the token the "model" samples next.
TokenFn = Callable[[str, list[int]], int]


def default_token_fn(request_id: str, tokens: list[int]) -> int:
    """A token that depends only on the sequence so far (so recomputation cannot change it)."""
    return 1000 + len(tokens)


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
) -> Request:
    params = SamplingParams(max_tokens=max_tokens, stop_token_ids=stop_token_ids, ignore_eos=ignore_eos)
    return Request(request_id, list(prompt), params, eos_token_id, arrival_time, priority)


def make_scheduler(
    *,
    num_blocks: int,
    block_size: int = 4,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 64,
    max_model_len: int = 1024,
    enable_prefix_caching: bool = True,
) -> Scheduler:
    return Scheduler(
        SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens),
        CacheConfig(block_size=block_size, enable_prefix_caching=enable_prefix_caching),
        num_kv_blocks=num_blocks,
        max_model_len=max_model_len,
    )


@dataclass
class _WorkerState:
    tokens: list[int]
    block_ids: list[int]
    num_computed: int
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
    states: dict[str, _WorkerState] = field(default_factory=dict)
    # slot -> fingerprint of the token sequence (up to and including that position) whose KV sits there.
    slots: dict[int, int] = field(default_factory=dict)

    def _slot(self, state: _WorkerState, position: int) -> int:
        return state.block_ids[position // self.block_size] * self.block_size + position % self.block_size

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        for req_id in out.finished_req_ids:
            self.states.pop(req_id, None)
        for new in out.scheduled_new_reqs:
            assert new.req_id not in self.states, f"{new.req_id} sent as new while the worker holds it"
            self.states[new.req_id] = _WorkerState(
                tokens=list(new.prompt_token_ids) + list(new.output_token_ids),
                block_ids=list(new.block_ids),
                num_computed=new.num_computed_tokens,
            )
        cached = out.scheduled_cached_reqs
        for req_id, new_tokens, new_blocks, num_computed in zip(
            cached.req_ids,
            cached.new_token_ids,
            cached.new_block_ids,
            cached.num_computed_tokens,
            strict=True,
        ):
            state = self.states[req_id]
            assert state.num_computed == num_computed, (req_id, state.num_computed, num_computed)
            state.tokens.extend(new_tokens)
            state.block_ids.extend(new_blocks)
        scheduled_ids = [new.req_id for new in out.scheduled_new_reqs] + list(cached.req_ids)
        assert sorted(scheduled_ids) == sorted(out.num_scheduled_tokens), "scheduled ids disagree"
        assert out.total_num_scheduled_tokens == sum(out.num_scheduled_tokens.values())

        # Write the KV of every scheduled token first (all layers write before they attend) ...
        for req_id, num in out.num_scheduled_tokens.items():
            state = self.states[req_id]
            end = state.num_computed + num
            assert num >= 1 and end <= len(state.tokens), (req_id, state.num_computed, num, len(state.tokens))
            assert len(state.block_ids) * self.block_size >= end, f"{req_id}: too few blocks for {end} tokens"
            for position in range(state.num_computed, end):
                self.slots[self._slot(state, position)] = state.fingerprint(position)
        # ... then check that every position each request attends to holds its own prefix.
        req_ids, sampled = [], []
        for req_id, num in out.num_scheduled_tokens.items():
            state = self.states[req_id]
            end = state.num_computed + num
            for position in range(end):
                assert self.slots.get(self._slot(state, position)) == state.fingerprint(position), (
                    f"{req_id}: KV at position {position} (slot {self._slot(state, position)}) is stale"
                )
            state.num_computed = end
            reaches_end = end == len(state.tokens)
            if self.scheduler is not None and req_id in self.scheduler.requests:
                request = self.scheduler.requests[req_id]
                assert request.all_token_ids == state.tokens, f"{req_id}: worker tokens diverged"
                assert request.num_computed_tokens == end
                assert (request.num_computed_tokens == request.num_tokens) == reaches_end
            if reaches_end:
                # Like a real runner, the worker learns its own sampled token from the next delta.
                token = self.token_fn(req_id, list(state.tokens))
                req_ids.append(req_id)
                sampled.append([token])
        return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled)


def step(
    scheduler: Scheduler, worker: FakeWorker, check: bool = True
) -> tuple[SchedulerOutput, EngineCoreOutputs]:
    """One engine step: schedule, run the fake worker, update; invariants checked after each half."""
    out = scheduler.schedule()
    if check:
        check_invariants(scheduler)
        assert out.total_num_scheduled_tokens <= scheduler.max_num_batched_tokens
        assert len(out.num_scheduled_tokens) <= scheduler.max_num_seqs
    runner_output = worker.execute(out)
    outputs = scheduler.update_from_output(out, runner_output)
    if check:
        check_invariants(scheduler)
    return out, outputs


def run_until_done(
    scheduler: Scheduler, worker: FakeWorker, max_steps: int = 500
) -> tuple[dict[str, list[int]], dict[str, object]]:
    """Step until nothing is left; returns the emitted tokens and the finish reason per request."""
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
        assert output.request_id not in reasons, f"{output.request_id} reported after it finished"
        tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
        if output.finished:
            reasons[output.request_id] = output.finish_reason


def held_blocks(scheduler: Scheduler) -> dict[str, list[int]]:
    """Block ids each request holds (requests holding none left out)."""
    kv = scheduler.kv_cache_manager
    return {req_id: [b.block_id for b in blocks] for req_id, blocks in kv.req_to_blocks.items() if blocks}


def check_invariants(scheduler: Scheduler) -> None:
    """Pool and scheduler invariants that hold between any two calls into the scheduler."""
    kv = scheduler.kv_cache_manager
    pool = kv.block_pool
    block_size = scheduler.block_size
    holders: Counter[int] = Counter()
    for req_id, blocks in kv.req_to_blocks.items():
        ids = [b.block_id for b in blocks]
        assert len(ids) == len(set(ids)), f"{req_id} holds a block twice: {ids}"
        holders.update(ids)
    # Reference counts equal the number of holders.
    for block in pool.blocks:
        assert block.ref_cnt == holders[block.block_id], (block, holders[block.block_id])
    # The free queue holds exactly the unreferenced blocks, once each, with consistent links.
    queue = list(pool.free_queue)
    queue_ids = [b.block_id for b in queue]
    assert len(queue_ids) == len(set(queue_ids)), f"free queue holds a block twice: {queue_ids}"
    assert set(queue_ids) == {b.block_id for b in pool.blocks if b.ref_cnt == 0}
    assert kv.num_free_blocks == len(queue_ids) == sum(1 for b in pool.blocks if b.ref_cnt == 0)
    for prev, nxt in itertools.pairwise(queue):
        assert prev.next_free is nxt and nxt.prev_free is prev
    for block in pool.blocks:
        if block.ref_cnt > 0:
            assert block.prev_free is None and block.next_free is None, f"{block} held but linked"
    # The hash map and the blocks agree.
    for block_hash, block in pool.cached_blocks.items():
        assert block.block_hash == block_hash
    assert sum(1 for b in pool.blocks if b.block_hash is not None) == len(pool.cached_blocks)

    # Scheduler-side: queues are disjoint, hold only live requests, and respect the caps.
    running_ids = [r.request_id for r in scheduler.running]
    waiting_ids = [r.request_id for r in scheduler.waiting]
    assert not set(running_ids) & set(waiting_ids)
    assert sorted(running_ids + waiting_ids) == sorted(scheduler.requests)
    assert len(scheduler.running) <= scheduler.max_num_seqs
    keys = [r.sort_key for r in scheduler.waiting]
    assert keys == sorted(keys), "waiting queue out of priority / FCFS order"
    for request in scheduler.waiting:
        assert not kv.req_to_blocks.get(request.request_id), f"waiting {request} holds blocks"
        assert request.num_computed_tokens == 0
    tables: dict[str, list[int]] = {}
    for request in scheduler.running:
        table = [b.block_id for b in kv.req_to_blocks.get(request.request_id, [])]
        # A running request holds exactly the blocks its computed tokens need.
        assert len(table) == -(-request.num_computed_tokens // block_size), (request, table)
        assert request.num_computed_tokens <= request.num_tokens <= scheduler.max_seq_len
        tables[request.request_id] = table
    assert set(held_blocks(scheduler)) <= set(tables), "a request that is not running holds blocks"
    # A block in two tables must be a cached full block of equal prefixes at the same position.
    where: dict[int, list[tuple[str, int]]] = {}
    for req_id, table in tables.items():
        for index, block_id in enumerate(table):
            where.setdefault(block_id, []).append((req_id, index))
    for block_id, places in where.items():
        if len(places) < 2:
            continue
        assert pool.blocks[block_id].block_hash is not None, f"block {block_id} shared but not cached"
        indices = {index for _, index in places}
        assert len(indices) == 1, f"block {block_id} at different positions: {places}"
        (index,) = indices
        prefixes = {
            tuple(scheduler.requests[req_id].all_token_ids[: (index + 1) * block_size])
            for req_id, _ in places
        }
        assert len(prefixes) == 1, f"block {block_id} shared by different prefixes"
        for req_id, _ in places:
            assert scheduler.requests[req_id].num_computed_tokens >= (index + 1) * block_size


def assert_all_free(scheduler: Scheduler) -> None:
    """Nothing left: every block back in the free queue with no reference."""
    kv = scheduler.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks
    assert not held_blocks(scheduler)
    assert all(block.ref_cnt == 0 for block in kv.block_pool.blocks)
    assert not scheduler.running and not scheduler.waiting and not scheduler.requests
    check_invariants(scheduler)
