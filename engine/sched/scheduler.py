"""Continuous batching: every step re-forms the batch under one token budget.

There is no prefill or decode phase. Each scheduled sequence's `num_computed_tokens` catches up
with its `num_tokens` by as many tokens as the budget allows, which covers chunked prefill,
prefix-cache hits and decode with one loop. Running requests go first, in priority order; when the
KV cache runs out, the lowest-priority running request is preempted: by recompute for a single
sequence (its blocks freed, the request requeued), by swapping to the CPU pool for a group of
sequences (whose shared blocks recompute would duplicate). Swapped requests come back before any
waiting request is admitted, and nothing new is admitted in a step that preempted.

This module is that policy. The rest of a step lives beside it:
- engine/sched/kv_cache_manager.py: the blocks, reached only through KVCacheManager's methods;
- engine/sched/sequence_groups.py: the sequences of each request, parallel-sampling forks and beam steps
  (engine/sched/beam_search.py decides which beams); forks share blocks, copied on write;
- engine/sched/step_plan.py: the SchedulerOutput the step builds, and what the workers already hold;
- engine/sched/inflight.py: the steps in flight (async scheduling's placeholders, pipeline stages);
- engine/sched/output_builder.py: sampled tokens -> EngineCoreOutputs.
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
from collections.abc import Iterable

from engine.config import CacheConfig, SchedulerConfig
from engine.outputs import (
    EngineCoreOutput,
    EngineCoreOutputs,
    ModelRunnerOutput,
    SchedulerOutput,
    SchedulerStats,
)
from engine.sched.grammar import GrammarMatcher
from engine.sched.inflight import InflightSteps, has_pending_tokens
from engine.sched.kv_cache_manager import KVCacheManager, SequenceWant, SlotAllocation, max_sequence_len
from engine.sched.lora_slots import LoRASlotTable
from engine.sched.output_builder import OutputBuilder, SampledBySequence
from engine.sched.request import Request, RequestStatus, SequenceStatus
from engine.sched.sequence_groups import SequenceGroups
from engine.sched.speculation import Speculator
from engine.sched.step_plan import StepPlan, WorkerSequences
from engine.spec_decode.config import SpeculativeConfig

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class ScheduledStep:
    """What one schedule() call produced: the batch for the workers, and the outputs of requests
    it finished without running them (ignored, or cut short because they can never fit)."""

    scheduler_output: SchedulerOutput
    finished_outputs: list[EngineCoreOutput]


class Scheduler:
    """Decides, step by step, which requests run and how many tokens each sequence computes."""

    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        num_kv_blocks: int,
        max_model_len: int,
        num_cpu_blocks: int = 0,
        sliding_window: int | None = None,
        speculative_config: SpeculativeConfig | None = None,
        max_loras: int | None = None,
        async_scheduling: bool = False,
    ) -> None:
        self.max_num_seqs = scheduler_config.max_num_seqs
        self.max_num_batched_tokens = scheduler_config.max_num_batched_tokens
        self.preemption_mode = scheduler_config.preemption_mode
        self.block_size = cache_config.block_size
        self.max_model_len = max_model_len
        # `sliding_window`: the window past which blocks are freed (`freeing_window`), or None.
        self.kv_cache_manager = KVCacheManager(
            num_kv_blocks,
            cache_config.block_size,
            cache_config.enable_prefix_caching,
            num_cpu_blocks,
            sliding_window,
        )
        self.max_seq_len = max_sequence_len(
            max_model_len, num_kv_blocks, self.block_size, sliding_window, self.max_num_batched_tokens
        )
        self.worker_sequences = WorkerSequences()
        self.groups = SequenceGroups(self.kv_cache_manager, self.worker_sequences, self.max_seq_len)
        self.output_builder = OutputBuilder(self.groups, self.max_seq_len)
        self.speculator = (
            Speculator(speculative_config, self.kv_cache_manager, self.max_seq_len)
            if speculative_config is not None
            else None
        )
        self._drafting = False  # whether the step being scheduled takes drafts
        # Async scheduling: a sequence's next step may be scheduled while the one that samples its
        # next token is in flight. Speculation needs the tokens to propose the next drafts.
        self.async_scheduling = async_scheduling and self.speculator is None
        self.inflight = InflightSteps(self.async_scheduling)
        # The workers' LoRA adapter slots (None: LoRA is off).
        self.lora_slots = LoRASlotTable(max_loras) if max_loras is not None else None
        self.requests: dict[str, Request] = {}
        self.waiting: list[Request] = []  # sorted by Request.sort_key
        self.swapped: list[Request] = []  # sorted by Request.sort_key
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    # ---- requests in and out -------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        self.groups.add_request(request)
        self.requests[request.request_id] = request
        if self.speculator is not None:
            self.speculator.log_if_off(request)
        self._enqueue(self.waiting, request)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> None:
        """Finish requests from outside (aborts); unknown or finished ids are ignored."""
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is not None:
                for seq in request.live_seqs:
                    self.groups.finish_seq(seq, status.sequence_status)
                self._finish_request(request, status)

    def stop_sequence(self, request_id: str, index: int, stop_reason: str) -> None:
        """The front end found a stop string in one sequence: finish it (others of the request go on)."""
        request = self.requests.get(request_id)
        seq = next((s for s in request.live_seqs if s.index == index), None) if request else None
        if seq is None:
            return
        seq.stop_reason = stop_reason
        self.groups.finish_seq(seq, SequenceStatus.FINISHED_STOPPED)
        if not request.live_seqs:
            self._finish_request(request, RequestStatus.FINISHED_STOPPED)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; False (and nothing forgotten) while any request holds blocks."""
        return self.kv_cache_manager.reset_prefix_cache()

    def prefix_cache_summary(self) -> bytes:
        """The prefix cache's block hashes, compact (`BlockPool.cached_hash_summary`)."""
        return self.kv_cache_manager.prefix_cache_summary()

    # ---- one step ------------------------------------------------------------------------------

    def schedule(self) -> ScheduledStep:
        """Form the next batch: running requests first (preempting the lowest priority when blocks
        run out), then swapped requests, then waiting ones, all within one token budget."""
        plan = StepPlan(self.max_num_batched_tokens)
        num_preemptions_before = self.num_preemptions
        self._drafting = self.speculator is not None and self.speculator.allows(self._rows_in_use())
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
        if self.lora_slots is not None:
            plan.lora_loads = self.lora_slots.assign(request.lora_request for request in self.running)
        scheduler_output = plan.to_scheduler_output(self.worker_sequences.take_dropped())
        self.inflight.record(scheduler_output, self.groups.seqs)
        return ScheduledStep(scheduler_output, plan.finished_outputs)

    def may_schedule_ahead(self) -> bool:
        """Whether the next step may be planned before the one in flight returns: async scheduling,
        and every running request can run on placeholders (else one plain step waits for them)."""
        return self.async_scheduling and all(request.runs_on_placeholders for request in self.running)

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> EngineCoreOutputs:
        """Append sampled tokens (or pick beams), stop finished sequences, free their blocks at once.

        The tokens of a sequence preempted while its step was in flight on a placeholder count too:
        the step after that one was planned on them."""
        sampled = SampledBySequence.of(runner_output)
        scheduled = self.inflight.take(scheduler_output)
        drafts = scheduler_output.scheduled_spec_decode_tokens
        for seq_id in drafts.keys() | set(scheduler_output.draft_seq_ids):
            seq = self.groups.seqs.get(seq_id)
            if seq is not None and seq.status == SequenceStatus.RUNNING and self.speculator is not None:
                num_drafts = len(drafts.get(seq_id, ()))
                self.speculator.settle(seq, num_drafts, len(sampled.token_ids.get(seq_id, ())))
        requests: dict[str, Request] = {}
        for seq_id in scheduler_output.num_scheduled_tokens:
            seq = self.groups.seqs.get(seq_id)
            if seq is None or scheduled.get(seq_id, seq) is not seq:
                continue  # finished meanwhile (and maybe a new request of the same id came)
            filled = self.inflight.fill_placeholder(seq, sampled)
            if seq.status == SequenceStatus.RUNNING or filled:
                requests[seq.request_id] = seq.request
        outputs: list[EngineCoreOutput] = []
        for request in requests.values():
            outputs += self.output_builder.request_outputs(request, sampled)
            if not request.live_seqs:
                self._finish_request(request, RequestStatus.FINISHED_STOPPED)
        if self.speculator is not None:
            running = [r for r in requests.values() if r.status == RequestStatus.RUNNING]
            self.speculator.propose(running, self._rows_in_use(), runner_output.spec_token_ids)
        return EngineCoreOutputs(outputs=outputs, scheduler_stats=self.make_stats())

    def grammar_rows(self, scheduler_output: SchedulerOutput) -> list[tuple[str, GrammarMatcher]]:
        """(seq_id, matcher) of every scheduled sequence under a grammar that samples this step
        (its step reaches its last known token): the rows the step's token mask covers."""
        rows = []
        for seq_id in scheduler_output.num_scheduled_tokens:
            seq = self.groups.seqs.get(seq_id)
            if seq is not None and seq.grammar is not None and seq.num_computed_tokens == seq.num_tokens:
                rows.append((seq_id, seq.grammar))
        return rows

    def make_stats(self) -> SchedulerStats:
        kv = self.kv_cache_manager
        running_seqs = [seq for request in self.running for seq in request.live_seqs]
        stats = SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting) + len(self.swapped),
            kv_cache_usage=kv.usage(),
            num_kv_blocks=kv.num_blocks,
            num_preemptions=self.num_preemptions,
            prefix_cache_queries=self.prefix_cache_queries,
            prefix_cache_hits=self.prefix_cache_hits,
            kv_tokens_held=sum(seq.num_computed_tokens for seq in running_seqs),
            kv_slots_allocated=(kv.num_blocks - kv.num_free_blocks) * self.block_size,
            kv_logical_blocks=kv.num_logical_blocks(running_seqs),
        )
        if self.lora_slots is not None:
            stats.lora = self.lora_slots.stats(
                (request.lora_request for request in self.running),
                (request.lora_request for request in self.waiting + self.swapped),
            )
        return stats if self.speculator is None else self.speculator.add_stats(stats)

    # ---- scheduling one request ----------------------------------------------------------------

    def _schedule_request(self, request: Request, plan: StepPlan, may_preempt: bool = True) -> int | None:
        """Schedule a request's sequences within the budget; the tokens it took, or None if none.

        A sequence holding no blocks (new, or preempted for recompute) first takes its cached prefix.
        Without `may_preempt` (admission, resumption) the request only runs if it fits as things are.
        """
        for seq in request.live_seqs:
            # Blocks no query will see again go back first: this step's allocation may reuse them.
            self.kv_cache_manager.free_blocks_outside_window(seq)
        self.groups.fork_if_ready(request)
        wants = self._wants(request, plan.budget)
        if not wants:
            return None
        allocations = self._allocate(request, wants, plan, may_preempt)
        if allocations is None:
            return None
        for want, allocation in zip(wants, allocations, strict=True):
            seq = want.seq
            if want.num_hit_tokens or seq.num_computed_tokens == 0:
                self.prefix_cache_queries += seq.num_tokens
                self.prefix_cache_hits += want.num_hit_tokens
                seq.num_computed_tokens = want.num_hit_tokens
                if seq.index == 0 and request.num_cached_tokens < 0:
                    request.num_cached_tokens = want.num_hit_tokens
            self.worker_sequences.record(seq, want.num_new_tokens, allocation, self.kv_cache_manager, plan)
            self.inflight.add_placeholder(request, seq)
            if want.drafts:
                plan.drafts[seq.seq_id] = want.drafts
            if want.num_lookahead_tokens:
                plan.draft_seq_ids.append(seq.seq_id)
        taken = sum(want.num_new_tokens for want in wants)
        plan.budget -= taken
        return taken

    def _wants(self, request: Request, budget: int) -> list[SequenceWant]:
        """What each live sequence of a request would compute this step, within `budget` tokens."""
        kv = self.kv_cache_manager
        wants = []
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
            if seq.pending_reach_limit(self.max_seq_len):
                num_new = 0
            drafts = []
            if (
                self._drafting
                and num_new == 1
                and seq.spec_token_ids
                and seq.num_computed_tokens == seq.num_tokens - 1
            ):
                # A decode: its drafts ride along, as many as the budget has room for.
                drafts = seq.spec_token_ids[: budget - 1]
                num_new += len(drafts)
            # A sequence that samples this step gets lookahead slots for a draft model's proposals.
            samples = seq.num_computed_tokens + num_hit_tokens + num_new - len(drafts) == seq.num_tokens
            lookahead = self.speculator.lookahead_for(request) if self._drafting and samples else 0
            if num_new > 0:  # else its step is in flight, or the budget is spent
                wants.append(SequenceWant(seq, num_new, hits, num_hit_tokens, drafts, lookahead))
                budget -= num_new
        return wants

    def _allocate(
        self, request: Request, wants: list[SequenceWant], plan: StepPlan, may_preempt: bool
    ) -> list[SlotAllocation] | None:
        """Blocks for every wanted sequence, preempting from the back of the queue until they fit.

        Returns None when they do not fit and `may_preempt` is off, or when `request` itself had to
        go (preempted, or finished because not even the whole cache can hold it). A request with
        tokens in flight (async scheduling) is finished only once they are known, at a later step:
        they are its own, as they would be without async scheduling.
        """
        kv = self.kv_cache_manager
        if len(wants) == 1:
            (want,) = wants
            if kv.num_blocks_held_after(want.seq, want.num_new_tokens) > kv.num_blocks:
                # A lone sequence longer than the whole cache: preempting others would not help.
                if may_preempt and not has_pending_tokens(request):
                    self._cap_request(request, "the sequence outgrew the whole KV cache", plan)
                return None
        while True:
            allocations = kv.allocate_group(wants)
            if allocations is not None:
                for allocation in allocations:
                    plan.copies += allocation.copies
                return allocations
            if not may_preempt:
                return None
            victim = self.running[-1]  # sorted: the last one has the lowest priority
            if victim is request and len(self.running) == 1:
                if not has_pending_tokens(request):
                    self._cap_request(request, "its sequences do not fit the whole KV cache", plan)
                return None
            self._preempt(victim, plan)
            if victim is request:
                return None

    # ---- admission and resumption --------------------------------------------------------------

    def _rows_in_use(self) -> int:
        return sum(request.max_concurrent_seqs for request in self.running)

    def _admit_waiting(self, plan: StepPlan) -> None:
        index = 0  # requests before it wait for their grammars
        while index < len(self.waiting) and plan.budget > 0:
            request = self.waiting[index]
            if request.waits_for_grammar:
                index += 1  # compiling off the step loop: those behind it may go first (as in vLLM)
                continue
            error = self._never_fits(request)
            if error is not None:
                self.waiting.pop(index)
                logger.warning("request %s ignored: %s", request.request_id, error)
                self._cap_request(request, error, plan, RequestStatus.FINISHED_IGNORED)
                continue
            error = request.start_grammar()
            if error is not None:
                self.waiting.pop(index)
                logger.warning("request %s failed: %s", request.request_id, error)
                self._cap_request(request, error, plan, RequestStatus.FINISHED_ABORTED)
                continue
            if self._rows_in_use() + request.max_concurrent_seqs > self.max_num_seqs:
                break
            if not self._adapter_fits(request):
                index += 1  # every slot runs another adapter: requests of those may go first (as in vLLM)
                continue
            if self._schedule_request(request, plan, may_preempt=False) is None:
                if not self.running:
                    # The whole cache is free and still too small: it would hold up the queue forever.
                    self._cap_request(request, "its sequences do not fit the whole KV cache", plan)
                    continue
                break  # FCFS: nobody overtakes the head of the queue
            self.waiting.pop(index)
            self._start(request)

    def _adapter_fits(self, request: Request) -> bool:
        """Whether the running requests' LoRA adapters, with this request's, fit the workers' slots."""
        slots = self.lora_slots
        return slots is None or slots.fits(
            (running.lora_request for running in self.running), request.lora_request, slots.max_loras
        )

    def _never_fits(self, request: Request) -> str | None:
        """Why a waiting request can never be admitted (it would hold up everyone behind it), if so."""
        if request.num_prompt_tokens > self.max_seq_len:
            return (
                f"prompt of {request.num_prompt_tokens} tokens does not fit the KV cache "
                f"({self.kv_cache_manager.num_blocks} blocks of {self.block_size} tokens)"
            )
        if request.max_concurrent_seqs > self.max_num_seqs:
            return f"its {request.max_concurrent_seqs} sequences exceed max_num_seqs ({self.max_num_seqs})"
        return None

    def _swap_in(self, plan: StepPlan) -> None:
        """Resume swapped requests, in priority order, while blocks and rows allow."""
        kv = self.kv_cache_manager
        while self.swapped:
            request = self.swapped[0]
            seqs = request.live_seqs
            if (
                self._rows_in_use() + request.max_concurrent_seqs > self.max_num_seqs
                or not self._adapter_fits(request)
                or not kv.can_swap_in(seqs)
            ):
                return
            self.swapped.pop(0)
            plan.swap_in += kv.swap_in(seqs)
            self._start(request)
            if plan.budget > 0:
                self._schedule_request(request, plan, may_preempt=False)

    def _start(self, request: Request) -> None:
        if request.status == RequestStatus.WAITING:  # not a preempted or swapped request resuming
            self.output_builder.mark_first_scheduled(request.request_id)
        self._set_status(request, RequestStatus.RUNNING)
        self.running.append(request)

    # ---- preemption ----------------------------------------------------------------------------

    def _preempt(self, request: Request, plan: StepPlan) -> None:
        """Swap a group of sequences out to the CPU pool, or free a request for recompute."""
        kv = self.kv_cache_manager
        seqs = request.live_seqs
        mode = self.preemption_mode or ("swap" if len(seqs) > 1 else "recompute")
        self.running.remove(request)
        self.num_preemptions += 1
        request.num_preemptions += 1
        for seq in seqs:
            self.worker_sequences.drop(seq.seq_id)
        if mode == "swap" and kv.can_swap_out(seqs):
            plan.swap_out += kv.swap_out(seqs)
            self._set_status(request, RequestStatus.SWAPPED)
            self._enqueue(self.swapped, request)
            return
        if mode == "swap":
            logger.warning("swap space is full: request %s is preempted by recompute", request.request_id)
        for seq in seqs:
            kv.free(seq)
            seq.num_computed_tokens = 0
        self._set_status(request, RequestStatus.PREEMPTED)
        self._enqueue(self.waiting, request)

    @staticmethod
    def _set_status(request: Request, status: RequestStatus) -> None:
        """Move a request and its live sequences to a queue's status together."""
        request.status = status
        for seq in request.live_seqs:
            seq.status = status.sequence_status

    @staticmethod
    def _enqueue(queue: list[Request], request: Request) -> None:
        bisect.insort(queue, request, key=lambda r: r.sort_key)

    # ---- finishing -----------------------------------------------------------------------------

    def _cap_request(
        self,
        request: Request,
        error: str,
        plan: StepPlan,
        status: RequestStatus = RequestStatus.FINISHED_LENGTH_CAPPED,
    ) -> None:
        """Finish a request that can never fit, reporting every live sequence as cut by length."""
        request.error = error
        plan.finished_outputs += self.output_builder.finish_all(request, status.sequence_status)
        self._finish_request(request, status)

    def _finish_request(self, request: Request, status: RequestStatus) -> None:
        """Unlink a request whose sequences are all finished."""
        for queue in (self.running, self.waiting, self.swapped):
            if request in queue:
                queue.remove(request)
        request.status = status
        self.requests.pop(request.request_id, None)
        self.output_builder.forget_request(request.request_id)
        self.groups.forget_request(request.request_id)
