"""Continuous batching: every step re-forms the batch under one token budget.

There is no prefill or decode phase. Each scheduled request's `num_computed_tokens` catches up with
its `num_tokens` by as many tokens as the budget allows, which covers chunked prefill, prefix-cache
hits and decode with one loop. Running requests go first, in priority order; when the KV cache runs
out, the lowest-priority running request is preempted (its blocks freed, the request requeued to be
recomputed). Waiting requests are admitted only in steps that preempted nothing.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Iterable

from engine.block_pool import KVCacheBlock
from engine.config import CacheConfig, SchedulerConfig
from engine.kv_cache_manager import KVCacheManager, cdiv
from engine.outputs import (
    CachedRequestData,
    EngineCoreOutput,
    EngineCoreOutputs,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
    SchedulerStats,
)
from engine.request import Request, RequestStatus

logger = logging.getLogger(__name__)


class Scheduler:
    """Decides, step by step, which requests run and how many tokens each computes."""

    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        num_kv_blocks: int,
        max_model_len: int,
    ) -> None:
        self.max_num_seqs = scheduler_config.max_num_seqs
        self.max_num_batched_tokens = scheduler_config.max_num_batched_tokens
        self.block_size = cache_config.block_size
        self.max_model_len = max_model_len
        self.kv_cache_manager = KVCacheManager(
            num_kv_blocks, cache_config.block_size, cache_config.enable_prefix_caching
        )
        # A request never holds more tokens than the whole cache: it stops there, cut by length.
        self.max_seq_len = min(max_model_len, num_kv_blocks * cache_config.block_size)
        self.requests: dict[str, Request] = {}
        self.waiting: list[Request] = []  # sorted by Request.sort_key
        self.running: list[Request] = []
        # Requests the workers hold state for that finished since the last step.
        self.finished_req_ids: set[str] = set()
        # Requests finished inside schedule() (ignored or capped); reported by the next update.
        self._finished_while_scheduling: list[Request] = []
        # Tokens of each request the workers have been sent (the rest go out as deltas).
        self._num_tokens_sent: dict[str, int] = {}
        self.num_preemptions = 0
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    # ---- requests in and out -------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self._enqueue(request)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> None:
        """Finish requests from outside (aborts); unknown or finished ids are ignored."""
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None or request.is_finished:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            self._finish(request, status)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running or self._finished_while_scheduling)

    def get_num_unfinished_requests(self) -> int:
        return len(self.waiting) + len(self.running)

    # ---- one step ------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        num_scheduled: dict[str, int] = {}
        new_reqs: list[NewRequestData] = []
        cached = CachedRequestData()

        num_preemptions_before = self.num_preemptions
        self.running.sort(key=lambda r: r.sort_key)
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if num_new <= 0:  # its last step is still in flight
                index += 1
                continue
            new_blocks = self._allocate_or_preempt(request, num_new)
            if new_blocks is None:
                if request.status == RequestStatus.PREEMPTED:
                    break  # it was the lowest-priority request left: nothing after it can run
                continue  # it finished (capped by the cache size); the next one took its index
            sent = self._num_tokens_sent[request.request_id]
            cached.req_ids.append(request.request_id)
            cached.new_token_ids.append(request.all_token_ids[sent:])
            cached.new_block_ids.append([block.block_id for block in new_blocks])
            cached.num_computed_tokens.append(request.num_computed_tokens)
            self._mark_scheduled(request, num_new, num_scheduled)
            budget -= num_new
            index += 1

        # Admitting new work while evicting running work would only thrash the cache.
        if self.num_preemptions == num_preemptions_before:
            self._admit_waiting(budget, num_scheduled, new_reqs)

        output = SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=sum(num_scheduled.values()),
            finished_req_ids=sorted(self.finished_req_ids),
        )
        self.finished_req_ids.clear()
        return output

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> EngineCoreOutputs:
        """Append sampled tokens, stop finished requests and free their blocks at once."""
        outputs: list[EngineCoreOutput] = []
        sampled = dict(zip(runner_output.req_ids, runner_output.sampled_token_ids, strict=True))
        for request_id in scheduler_output.num_scheduled_tokens:
            request = self.requests.get(request_id)
            token_ids = sampled.get(request_id)
            if request is None or request.is_finished or not token_ids:
                continue  # aborted meanwhile, or a prefill chunk that sampled nothing
            new_token_ids = []
            for token_id in token_ids:
                request.append_output_token(token_id)
                new_token_ids.append(token_id)
                status = self._stop_status(request)
                if status is not None:
                    self.running.remove(request)
                    self._finish(request, status)
                    break
            outputs.append(self._output(request, new_token_ids))
        for request in self._finished_while_scheduling:
            outputs.append(self._output(request, []))
        self._finished_while_scheduling.clear()
        return EngineCoreOutputs(outputs=outputs, scheduler_stats=self.make_stats())

    def make_stats(self) -> SchedulerStats:
        kv = self.kv_cache_manager
        return SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting),
            kv_cache_usage=kv.usage(),
            num_kv_blocks=kv.num_blocks,
            num_preemptions=self.num_preemptions,
            prefix_cache_queries=self.prefix_cache_queries,
            prefix_cache_hits=self.prefix_cache_hits,
            kv_tokens_held=sum(request.num_computed_tokens for request in self.running),
            kv_slots_allocated=(kv.num_blocks - kv.num_free_blocks) * self.block_size,
        )

    # ---- helpers -------------------------------------------------------------------------------

    def _allocate_or_preempt(self, request: Request, num_new: int) -> list[KVCacheBlock] | None:
        """Blocks for a running request, preempting from the back of the queue until they fit.

        Returns None when `request` itself had to go (preempted, or finished because not even the
        whole cache can hold it).
        """
        kv = self.kv_cache_manager
        if cdiv(request.num_computed_tokens + num_new, self.block_size) > kv.num_blocks:
            self.running.remove(request)
            self._finish(request, RequestStatus.FINISHED_LENGTH_CAPPED)
            self._finished_while_scheduling.append(request)
            return None
        while True:
            new_blocks = kv.allocate_slots(request, num_new)
            if new_blocks is not None:
                return new_blocks
            victim = self.running.pop()  # sorted: the last one has the lowest priority
            self._preempt(victim)
            if victim is request:
                return None

    def _admit_waiting(
        self, budget: int, num_scheduled: dict[str, int], new_reqs: list[NewRequestData]
    ) -> None:
        kv = self.kv_cache_manager
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            if request.num_tokens > self.max_seq_len:
                self.waiting.pop(0)
                request.error = (
                    f"prompt of {request.num_tokens} tokens does not fit the KV cache "
                    f"({kv.num_blocks} blocks of {self.block_size} tokens)"
                )
                logger.warning("request %s ignored: %s", request.request_id, request.error)
                self._finish(request, RequestStatus.FINISHED_IGNORED)
                self._finished_while_scheduling.append(request)
                continue
            hits, num_hit_tokens = kv.get_computed_blocks(request)
            num_new = min(request.num_tokens - num_hit_tokens, budget)
            new_blocks = kv.allocate_slots(request, num_new, hits)
            if new_blocks is None:
                break  # FCFS: nobody overtakes the head of the queue
            self.waiting.pop(0)
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += num_hit_tokens
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit_tokens
            request.num_computed_tokens = num_hit_tokens
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            new_reqs.append(
                NewRequestData(
                    req_id=request.request_id,
                    prompt_token_ids=request.prompt_token_ids,
                    output_token_ids=list(request.output_token_ids),
                    sampling_params=request.sampling_params,
                    block_ids=kv.block_ids(request.request_id),
                    num_computed_tokens=num_hit_tokens,
                )
            )
            self._mark_scheduled(request, num_new, num_scheduled)
            budget -= num_new

    def _mark_scheduled(self, request: Request, num_new: int, num_scheduled: dict[str, int]) -> None:
        num_scheduled[request.request_id] = num_new
        request.num_computed_tokens += num_new
        self._num_tokens_sent[request.request_id] = request.num_tokens

    def _preempt(self, request: Request) -> None:
        """Recompute preemption: free every block and requeue (prefix-cache hits soften the cost)."""
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.finished_req_ids.add(request.request_id)  # the workers drop its state
        self._num_tokens_sent.pop(request.request_id, None)
        self._enqueue(request)

    def _enqueue(self, request: Request) -> None:
        bisect.insort(self.waiting, request, key=lambda r: r.sort_key)

    def _stop_status(self, request: Request) -> RequestStatus | None:
        token_id = request.output_token_ids[-1]
        params = request.sampling_params
        if token_id == request.eos_token_id and not params.ignore_eos:
            return RequestStatus.FINISHED_STOPPED
        if token_id in params.all_stop_token_ids:
            request.stop_reason = token_id
            return RequestStatus.FINISHED_STOPPED
        max_tokens = params.max_tokens
        if (max_tokens is not None and request.num_output_tokens >= max_tokens) or (
            request.num_tokens >= self.max_seq_len
        ):
            return RequestStatus.FINISHED_LENGTH_CAPPED
        return None

    def _finish(self, request: Request, status: RequestStatus) -> None:
        """Mark a request finished and release its blocks now; the caller has unlinked it."""
        request.status = status
        self.kv_cache_manager.free(request)
        self.kv_cache_manager.forget(request)
        self.finished_req_ids.add(request.request_id)
        self._num_tokens_sent.pop(request.request_id, None)
        del self.requests[request.request_id]

    def _output(self, request: Request, new_token_ids: list[int]) -> EngineCoreOutput:
        return EngineCoreOutput(
            request_id=request.request_id,
            new_token_ids=new_token_ids,
            finish_reason=request.status.finish_reason,
            stop_reason=request.stop_reason,
            num_cached_tokens=max(request.num_cached_tokens, 0),
            error=request.error,
        )
