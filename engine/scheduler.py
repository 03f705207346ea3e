"""Continuous batching: every step re-forms the batch under one token budget.

There is no prefill or decode phase. Each scheduled sequence's `num_computed_tokens` catches up
with its `num_tokens` by as many tokens as the budget allows, which covers chunked prefill,
prefix-cache hits and decode with one loop. Running requests go first, in priority order; when the
KV cache runs out, the lowest-priority running request is preempted: by recompute for a single
sequence (its blocks freed, the request requeued), by swapping to the CPU pool for a group of
sequences (whose shared blocks recompute would duplicate). Swapped requests come back before any
waiting request is admitted, and nothing new is admitted in a step that preempted.

Requests are groups of sequences (engine/request.py): parallel sampling forks the prompt's
sequence once its prompt is cached, and beam search forks and prunes beams every step
(engine/beam_search.py decides which); forks share blocks, copied on write.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Iterable

from engine.beam_search import BeamSearchState
from engine.config import CacheConfig, SchedulerConfig
from engine.kv_cache_manager import KVCacheManager, SlotAllocation, cdiv
from engine.outputs import (
    CachedSequenceData,
    EngineCoreOutput,
    EngineCoreOutputs,
    LogprobsLists,
    ModelRunnerOutput,
    NewSequenceData,
    SchedulerOutput,
    SchedulerStats,
)
from engine.request import Request, RequestStatus, Sequence

logger = logging.getLogger(__name__)


class _StepPlan:
    """What one schedule() call accumulates into the SchedulerOutput."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.num_scheduled: dict[str, int] = {}
        self.new_seqs: list[NewSequenceData] = []
        self.cached = CachedSequenceData()
        self.swap_out: list[tuple[int, int]] = []
        self.swap_in: list[tuple[int, int]] = []
        self.copies: list[tuple[int, int]] = []


class Scheduler:
    """Decides, step by step, which requests run and how many tokens each sequence computes."""

    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        num_kv_blocks: int,
        max_model_len: int,
        num_cpu_blocks: int = 0,
    ) -> None:
        self.max_num_seqs = scheduler_config.max_num_seqs
        self.max_num_batched_tokens = scheduler_config.max_num_batched_tokens
        self.preemption_mode = scheduler_config.preemption_mode
        self.block_size = cache_config.block_size
        self.max_model_len = max_model_len
        self.kv_cache_manager = KVCacheManager(
            num_kv_blocks, cache_config.block_size, cache_config.enable_prefix_caching, num_cpu_blocks
        )
        # A sequence never holds more tokens than the whole cache: it stops there, cut by length.
        self.max_seq_len = min(max_model_len, num_kv_blocks * cache_config.block_size)
        self.requests: dict[str, Request] = {}
        self.seqs: dict[str, Sequence] = {}  # live sequences by seq_id
        self.beam_states: dict[str, BeamSearchState] = {}
        self._beam_candidates: dict[str, dict[str, LogprobsLists]] = {}
        self.waiting: list[Request] = []  # sorted by Request.sort_key
        self.swapped: list[Request] = []  # sorted by Request.sort_key
        self.running: list[Request] = []
        # Sequences the workers hold state for that they must drop at the next step.
        self.finished_seq_ids: set[str] = set()
        # Outputs produced while scheduling (requests ignored or capped); sent with the next update.
        self._pending_outputs: list[EngineCoreOutput] = []
        # Tokens of each sequence the workers have been sent; absent: the workers do not hold it.
        self._num_tokens_sent: dict[str, int] = {}
        # time.time() of each request's first scheduling, until its first output carries it.
        self._first_scheduled_times: dict[str, float] = {}
        self.num_preemptions = 0
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    # ---- requests in and out -------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests or request.seqs[0].seq_id in self.seqs:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.seqs[request.seqs[0].seq_id] = request.seqs[0]
        if request.beam_search is not None:
            beam = request.beam_search
            eos = frozenset() if beam.ignore_eos or request.eos_token_id is None else {request.eos_token_id}
            # Beams stop where a sampled sequence would: at max_seq_len tokens (the last one sampled).
            max_tokens = min(beam.max_tokens, max(self.max_seq_len - request.num_prompt_tokens, 1))
            self.beam_states[request.request_id] = BeamSearchState(
                beam.beam_width, max_tokens, beam.length_penalty, frozenset(eos)
            )
        self._enqueue(self.waiting, request)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> None:
        """Finish requests from outside (aborts); unknown or finished ids are ignored."""
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is not None:
                for seq in request.live_seqs:
                    self._finish_seq(seq, status)
                self._finish_request(request, status)

    def stop_sequence(self, request_id: str, index: int, stop_reason: str) -> None:
        """The front end found a stop string in one sequence: finish it (others of the request go on)."""
        request = self.requests.get(request_id)
        seq = next((s for s in request.live_seqs if s.index == index), None) if request else None
        if seq is None:
            return
        seq.stop_reason = stop_reason
        self._finish_seq(seq, RequestStatus.FINISHED_STOPPED)
        if not request.live_seqs:
            self._finish_request(request, RequestStatus.FINISHED_STOPPED)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests or self._pending_outputs)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    # ---- one step ------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        plan = _StepPlan(self.max_num_batched_tokens)
        num_preemptions_before = self.num_preemptions
        self.running.sort(key=lambda r: r.sort_key)
        index = 0
        while index < len(self.running) and plan.budget > 0:
            request = self.running[index]
            self._schedule_request(request, plan)
            if request.status in (RequestStatus.PREEMPTED, RequestStatus.SWAPPED):
                break  # it was the lowest-priority request left: nothing after it can run
            if request.status == RequestStatus.RUNNING:
                index += 1  # (a request that finished, too big for the cache, left its index to the next)
        # Admitting work while evicting running work would only thrash the cache.
        if self.num_preemptions == num_preemptions_before:
            self._swap_in(plan)
            if not self.swapped:
                self._admit_waiting(plan)
        output = SchedulerOutput(
            scheduled_new_seqs=plan.new_seqs,
            scheduled_cached_seqs=plan.cached,
            num_scheduled_tokens=plan.num_scheduled,
            total_num_scheduled_tokens=sum(plan.num_scheduled.values()),
            finished_seq_ids=sorted(self.finished_seq_ids),
            blocks_to_swap_out=plan.swap_out,
            blocks_to_swap_in=plan.swap_in,
            blocks_to_copy=plan.copies,
        )
        self.finished_seq_ids.clear()
        return output

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> EngineCoreOutputs:
        """Append sampled tokens (or pick beams), stop finished sequences, free their blocks at once."""
        sampled = dict(zip(runner_output.seq_ids, runner_output.sampled_token_ids, strict=True))
        logprobs = dict(zip(runner_output.seq_ids, runner_output.logprobs, strict=False))
        outputs = self._pending_outputs
        self._pending_outputs = []
        requests: dict[str, Request] = {}
        for seq_id in scheduler_output.num_scheduled_tokens:
            seq = self.seqs.get(seq_id)
            if seq is not None and seq.status == RequestStatus.RUNNING:
                requests[seq.request_id] = seq.request
        for request in requests.values():
            prompt_logprobs = runner_output.prompt_logprobs.get(request.seqs[0].seq_id)
            if request.beam_search is not None:
                news = self._advance_beams(request, logprobs)
            else:
                news = self._append_tokens(request, sampled, logprobs, prompt_logprobs)
            if news and request.request_id in self._first_scheduled_times:
                news[0].first_scheduled_time = self._first_scheduled_times.pop(request.request_id)
            if not request.live_seqs:
                self._finish_request(request, RequestStatus.FINISHED_STOPPED)
                if news:
                    news[-1].request_finished = True
            outputs += news
        return EngineCoreOutputs(outputs=outputs, scheduler_stats=self.make_stats())

    def make_stats(self) -> SchedulerStats:
        kv = self.kv_cache_manager
        running_seqs = [seq for request in self.running for seq in request.live_seqs]
        return SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting) + len(self.swapped),
            kv_cache_usage=kv.usage(),
            num_kv_blocks=kv.num_blocks,
            num_preemptions=self.num_preemptions,
            prefix_cache_queries=self.prefix_cache_queries,
            prefix_cache_hits=self.prefix_cache_hits,
            kv_tokens_held=sum(seq.num_computed_tokens for seq in running_seqs),
            kv_slots_allocated=(kv.num_blocks - kv.num_free_blocks) * self.block_size,
            kv_logical_blocks=sum(len(kv.req_to_blocks.get(seq.seq_id, ())) for seq in running_seqs),
        )

    # ---- scheduling one request ----------------------------------------------------------------

    def _schedule_request(self, request: Request, plan: _StepPlan, may_preempt: bool = True) -> int | None:
        """Schedule a request's sequences within the budget; the tokens it took, or None if none.

        A sequence holding no blocks (new, or preempted for recompute) first takes its cached prefix.
        Without `may_preempt` (admission, resumption) the request only runs if it fits as things are.
        """
        self._fork_if_ready(request)
        kv = self.kv_cache_manager
        wants = []
        budget = plan.budget
        for seq in request.live_seqs:
            hits, num_hit_tokens = [], 0
            if seq.num_computed_tokens == 0 and request.sampling_params.prompt_logprobs is None:
                # Prompt log-probabilities need every prompt position computed: no prefix hits then.
                hits, num_hit_tokens = kv.get_computed_blocks(seq)
                if hits and num_hit_tokens >= request.target_num_tokens(seq):
                    # A sequence still to fork stops before the prompt's last token: leave it some of
                    # the cached prefix to compute, or it would never be scheduled (nor forked).
                    hits, num_hit_tokens = hits[:-1], num_hit_tokens - self.block_size
            num_new = min(request.target_num_tokens(seq) - seq.num_computed_tokens - num_hit_tokens, budget)
            if num_new > 0:  # else its step is in flight, or the budget is spent
                wants.append((seq, num_new, hits, num_hit_tokens))
                budget -= num_new
        if not wants:
            return None
        allocations = self._allocate(request, wants, plan, may_preempt)
        if allocations is None:
            return None
        for (seq, num_new, _, num_hit_tokens), allocation in zip(wants, allocations, strict=True):
            if num_hit_tokens or seq.num_computed_tokens == 0:
                self.prefix_cache_queries += seq.num_tokens
                self.prefix_cache_hits += num_hit_tokens
                seq.num_computed_tokens = num_hit_tokens
                if seq.index == 0 and request.num_cached_tokens < 0:
                    request.num_cached_tokens = num_hit_tokens
            self._record(seq, num_new, allocation, plan)
        taken = plan.budget - budget
        plan.budget = budget
        return taken

    def _allocate(
        self, request: Request, wants: list[tuple], plan: _StepPlan, may_preempt: bool
    ) -> list[SlotAllocation] | None:
        """Blocks for every wanted sequence, preempting from the back of the queue until they fit.

        Returns None when they do not fit and `may_preempt` is off, or when `request` itself had to
        go (preempted, or finished because not even the whole cache can hold it).
        """
        kv = self.kv_cache_manager
        if (
            len(wants) == 1
            and cdiv(wants[0][0].num_computed_tokens + wants[0][1], self.block_size) > kv.num_blocks
        ):
            # A lone sequence longer than the whole cache: preempting others would not help.
            if may_preempt:
                self._cap_request(request, "the sequence outgrew the whole KV cache")
            return None
        while True:
            if self._num_blocks_needed(wants) <= kv.num_free_blocks:
                # Hold every prefix hit first: one sequence's new blocks come from the head of the free
                # queue, where the hits of another sequence of the request may sit.
                pinned = [block for _, _, hits, _ in wants for block in hits]
                kv.block_pool.touch(pinned)
                allocations = [kv.allocate_slots(seq, num_new, hits) for seq, num_new, hits, _ in wants]
                kv.block_pool.free_blocks(pinned)
                for allocation in allocations:
                    plan.copies += allocation.copies
                return allocations
            if not may_preempt:
                return None
            victim = self.running[-1]  # sorted: the last one has the lowest priority
            if victim is request and len(self.running) == 1:
                self._cap_request(request, "its sequences do not fit the whole KV cache")
                return None
            self._preempt(victim, plan)
            if victim is request:
                return None

    def _num_blocks_needed(self, wants: list[tuple]) -> int:
        """Free blocks that allocating every wanted sequence of a request takes.

        `num_blocks_needed` sees one sequence alone: a prefix hit several sequences take counts once
        per sequence, and a shared block that all its holders write counts a copy for each, though
        the last writer keeps the block itself.
        """
        kv = self.kv_cache_manager
        needed = sum(kv.num_blocks_needed(seq, num_new, hits) for seq, num_new, hits, _ in wants)
        unheld_hits = [block.block_id for _, _, hits, _ in wants for block in hits if block.ref_cnt == 0]
        needed -= len(unheld_hits) - len(set(unheld_hits))
        writers: dict[int, int] = {}
        for seq, *_ in wants:
            table = kv.req_to_blocks.get(seq.seq_id, [])
            index = seq.num_computed_tokens // self.block_size
            if index < len(table) and table[index].ref_cnt > 1:
                writers[table[index].block_id] = writers.get(table[index].block_id, 0) + 1
        blocks = kv.block_pool.blocks
        return needed - sum(1 for block_id, count in writers.items() if count == blocks[block_id].ref_cnt)

    def _record(self, seq: Sequence, num_new: int, allocation: SlotAllocation, plan: _StepPlan) -> None:
        """Add a scheduled sequence to the step: full data if the workers lack it, deltas if not."""
        kv = self.kv_cache_manager
        request = seq.request
        sent = self._num_tokens_sent.get(seq.seq_id)
        if sent is None:
            params = request.sampling_params
            plan.new_seqs.append(
                NewSequenceData(
                    seq_id=seq.seq_id,
                    prompt_token_ids=request.prompt_token_ids,
                    output_token_ids=list(seq.output_token_ids),
                    sampling_params=params,
                    block_ids=kv.block_ids(seq.seq_id),
                    num_computed_tokens=seq.num_computed_tokens,
                    eos_token_id=request.eos_token_id,
                    seed=None if params.seed is None else params.seed + seq.index,
                    num_logprobs=self._num_logprobs(request),
                    num_prompt_logprobs=params.prompt_logprobs if seq.index == 0 else None,
                )
            )
        else:
            plan.cached.seq_ids.append(seq.seq_id)
            plan.cached.new_token_ids.append(seq.all_token_ids[sent:])
            plan.cached.block_table_starts.append(allocation.table_start)
            plan.cached.new_block_ids.append(allocation.block_ids)
            plan.cached.num_computed_tokens.append(seq.num_computed_tokens)
        plan.num_scheduled[seq.seq_id] = num_new
        seq.num_computed_tokens += num_new
        self._num_tokens_sent[seq.seq_id] = seq.num_tokens

    @staticmethod
    def _num_logprobs(request: Request) -> int | None:
        """Top-k log-probabilities the workers return per sampled token, for this request's sequences."""
        if request.beam_search is not None:
            return 2 * request.beam_search.beam_width  # the candidates of every beam
        params = request.sampling_params
        if params.logprobs is None and params.num_sequences > params.n:
            return 0  # best_of ranks sequences by cumulative log-probability
        return params.logprobs

    def _fork_if_ready(self, request: Request) -> None:
        """Parallel sampling: once the prompt but its last token is cached, fork the other sequences."""
        if not request.num_pending_forks:
            return
        parent = request.seqs[0]
        if parent.num_computed_tokens < request.num_prompt_tokens - 1:
            return
        for _ in range(request.num_pending_forks):
            self._add_fork(parent, request.new_seq_index())
        request.num_pending_forks = 0

    def _add_fork(self, parent: Sequence, index: int) -> Sequence:
        child = parent.fork(index)
        parent.request.seqs.append(child)
        self.seqs[child.seq_id] = child
        self.kv_cache_manager.fork(parent, child)
        return child

    # ---- admission and resumption --------------------------------------------------------------

    def _rows_in_use(self) -> int:
        return sum(request.max_num_seqs for request in self.running)

    def _admit_waiting(self, plan: _StepPlan) -> None:
        kv = self.kv_cache_manager
        while self.waiting and plan.budget > 0:
            request = self.waiting[0]
            error = None
            if request.num_prompt_tokens > self.max_seq_len:
                error = (
                    f"prompt of {request.num_prompt_tokens} tokens does not fit the KV cache "
                    f"({kv.num_blocks} blocks of {self.block_size} tokens)"
                )
            elif request.max_num_seqs > self.max_num_seqs:
                # It could never be admitted, and would hold up everyone behind it.
                error = f"its {request.max_num_seqs} sequences exceed max_num_seqs ({self.max_num_seqs})"
            if error is not None:
                self.waiting.pop(0)
                logger.warning("request %s ignored: %s", request.request_id, error)
                self._cap_request(request, error, RequestStatus.FINISHED_IGNORED)
                continue
            if self._rows_in_use() + request.max_num_seqs > self.max_num_seqs:
                break
            if self._schedule_request(request, plan, may_preempt=False) is None:
                if not self.running:
                    # The whole cache is free and still too small: it would hold up the queue forever.
                    self._cap_request(request, "its sequences do not fit the whole KV cache")
                    continue
                break  # FCFS: nobody overtakes the head of the queue
            self.waiting.pop(0)
            self._start(request)

    def _swap_in(self, plan: _StepPlan) -> None:
        """Resume swapped requests, in priority order, while blocks and rows allow."""
        kv = self.kv_cache_manager
        while self.swapped:
            request = self.swapped[0]
            seqs = request.live_seqs
            if self._rows_in_use() + request.max_num_seqs > self.max_num_seqs or not kv.can_swap_in(seqs):
                return
            self.swapped.pop(0)
            plan.swap_in += kv.swap_in(seqs)
            self._start(request)
            if plan.budget > 0:
                self._schedule_request(request, plan, may_preempt=False)

    def _start(self, request: Request) -> None:
        if request.status == RequestStatus.WAITING:  # not a preempted or swapped request resuming
            self._first_scheduled_times[request.request_id] = time.time()
        request.status = RequestStatus.RUNNING
        for seq in request.live_seqs:
            seq.status = RequestStatus.RUNNING
        self.running.append(request)

    # ---- preemption ----------------------------------------------------------------------------

    def _preempt(self, request: Request, plan: _StepPlan) -> None:
        """Swap a group of sequences out to the CPU pool, or free a request for recompute."""
        kv = self.kv_cache_manager
        seqs = request.live_seqs
        mode = self.preemption_mode or ("swap" if len(seqs) > 1 else "recompute")
        self.running.remove(request)
        self.num_preemptions += 1
        request.num_preemptions += 1
        for seq in seqs:
            self._num_tokens_sent.pop(seq.seq_id, None)
            self.finished_seq_ids.add(seq.seq_id)  # the workers drop it
        if mode == "swap" and kv.can_swap_out(seqs):
            plan.swap_out += kv.swap_out(seqs)
            request.status = RequestStatus.SWAPPED
            for seq in seqs:
                seq.status = RequestStatus.SWAPPED
            self._enqueue(self.swapped, request)
            return
        if mode == "swap":
            logger.warning("swap space is full: request %s is preempted by recompute", request.request_id)
        for seq in seqs:
            kv.free(seq)
            seq.num_computed_tokens = 0
            seq.status = RequestStatus.PREEMPTED
        request.status = RequestStatus.PREEMPTED
        self._enqueue(self.waiting, request)

    @staticmethod
    def _enqueue(queue: list[Request], request: Request) -> None:
        bisect.insort(queue, request, key=lambda r: r.sort_key)

    # ---- outputs -------------------------------------------------------------------------------

    def _append_tokens(
        self,
        request: Request,
        sampled: dict[str, list[int]],
        logprobs: dict[str, LogprobsLists | None],
        prompt_logprobs: LogprobsLists | None,
    ) -> list[EngineCoreOutput]:
        outputs = []
        for seq in list(request.live_seqs):
            token_ids = sampled.get(seq.seq_id)
            if not token_ids:
                if seq.index == 0 and prompt_logprobs is not None:  # a prefill chunk that sampled nothing
                    outputs.append(seq.make_output([], prompt_logprobs=prompt_logprobs))
                continue
            seq_logprobs = logprobs.get(seq.seq_id)
            for i, token_id in enumerate(token_ids):
                seq.append_output_token(token_id, seq_logprobs.logprobs[i][0] if seq_logprobs else None)
                status = seq.check_stop(self.max_seq_len)
                if status is not None:
                    self._finish_seq(seq, status)
                    break
            outputs.append(
                seq.make_output(
                    token_ids[: i + 1],
                    seq_logprobs.slice(0, i + 1) if seq_logprobs else None,
                    prompt_logprobs if seq.index == 0 else None,
                )
            )
        return outputs

    def _advance_beams(
        self, request: Request, logprobs: dict[str, LogprobsLists | None]
    ) -> list[EngineCoreOutput]:
        """One beam search step: keep the best beams (forking, pruning), finish when the search ends.

        A step needs every live beam's candidates; beams that got theirs early (chunked recompute
        after a preemption) wait for the others.
        """
        pending = self._beam_candidates.setdefault(request.request_id, {})
        beams = request.live_seqs
        for seq in beams:
            if logprobs.get(seq.seq_id) is not None:
                pending[seq.seq_id] = logprobs[seq.seq_id]
        if any(seq.seq_id not in pending for seq in beams):
            return []
        options = [pending.pop(seq.seq_id) for seq in beams]
        state = self.beam_states[request.request_id]
        step = state.step(
            [seq.output_token_ids for seq in beams],
            [seq.cumulative_logprob for seq in beams],
            [list(zip(o.token_ids[0][1:], o.logprobs[0][1:], strict=True)) for o in options],
        )
        if step.done:
            for seq in beams:
                self._finish_seq(seq, RequestStatus.FINISHED_PRUNED)
            return request.beam_outputs(state.results())
        # Fork every beam chosen more than once before extending any, so forks start from the same tokens.
        extended: set[int] = set()
        targets = []
        for candidate in step.next_beams:
            parent = beams[candidate.parent]
            targets.append(
                self._add_fork(parent, request.new_seq_index()) if candidate.parent in extended else parent
            )
            extended.add(candidate.parent)
        for candidate, seq in zip(step.next_beams, targets, strict=True):
            seq.append_output_token(candidate.token_id)
            seq.cumulative_logprob = candidate.cumulative_logprob
        for position, seq in enumerate(beams):
            if position not in extended:
                self._finish_seq(seq, RequestStatus.FINISHED_PRUNED)
        return []

    # ---- finishing -----------------------------------------------------------------------------

    def _cap_request(
        self, request: Request, error: str, status: RequestStatus = RequestStatus.FINISHED_LENGTH_CAPPED
    ) -> None:
        """Finish a request that can never fit, reporting every live sequence as cut by length."""
        request.error = error
        news = []
        for seq in request.live_seqs:
            self._finish_seq(seq, status)
            news.append(seq.make_output([]))
        news[-1].request_finished = True
        self._pending_outputs += news
        self._finish_request(request, status)

    def _finish_seq(self, seq: Sequence, status: RequestStatus) -> None:
        """Mark a sequence finished and release its blocks now."""
        seq.status = status
        self.kv_cache_manager.free(seq)
        self.kv_cache_manager.forget(seq)
        self.seqs.pop(seq.seq_id, None)
        if self._num_tokens_sent.pop(seq.seq_id, None) is not None:
            self.finished_seq_ids.add(seq.seq_id)

    def _finish_request(self, request: Request, status: RequestStatus) -> None:
        """Unlink a request whose sequences are all finished."""
        for queue in (self.running, self.waiting, self.swapped):
            if request in queue:
                queue.remove(request)
        request.status = status
        self.requests.pop(request.request_id, None)
        self._first_scheduled_times.pop(request.request_id, None)
        self.beam_states.pop(request.request_id, None)
        self._beam_candidates.pop(request.request_id, None)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; False (nothing changed) while any request holds blocks."""
        return self.kv_cache_manager.block_pool.reset_prefix_cache()
