"""EngineCore: the scheduler and the executor, driven one step at a time."""

from __future__ import annotations

import collections
import concurrent.futures
import logging
from collections.abc import Callable, Sequence
from typing import Any

import msgspec

from engine.config import EngineConfig
from engine.executor.base import Executor
from engine.lora.request import LoRARequest
from engine.outputs import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    ModelRunnerOutput,
    SchedulerOutput,
    SchedulerStats,
)
from engine.sched.kv_cache_manager import freeing_window
from engine.sched.request import Request, RequestStatus
from engine.sched.scheduler import Scheduler
from engine.structured.manager import StructuredOutputManager

logger = logging.getLogger(__name__)

# How long a step with nothing to run waits for a grammar being compiled (new inputs wait as long).
GRAMMAR_WAIT_S = 0.005


class EngineCore:
    """Owns the scheduler and the workers (through an executor) of one engine.

    `config` must be resolved (`resolve_engine_config`): concrete model path, dtype and max_model_len.
    """

    def __init__(self, config: EngineConfig, executor_class: type[Executor] | None = None) -> None:
        self.config = config
        self.executor = (executor_class or Executor.get_class(config))(config)
        num_blocks, num_cpu_blocks = self.executor.initialize_kv_cache()
        max_model_len = config.model.max_model_len
        block_size = config.cache.block_size
        logger.info(
            "KV cache: %d blocks of %d tokens (%d tokens); maximum concurrency at %d tokens per request: %.2fx",
            num_blocks,
            block_size,
            num_blocks * block_size,
            max_model_len,
            num_blocks * block_size / max_model_len,
        )
        self.scheduler = Scheduler(
            config.scheduler,
            config.cache,
            num_blocks,
            max_model_len,
            num_cpu_blocks,
            freeing_window(config.model.hf_config.layer_windows),
            config.speculative.speculative_config,
            config.lora.max_loras if config.lora.enable_lora else None,
            # With pipeline stages the batch queue already overlaps scheduling with the forward pass
            # (one batch per stage, disjoint requests); placeholders would need the last stage's
            # tokens on the first before the next step's inputs, so they are for one stage only.
            config.scheduler.async_scheduling and config.parallel.pipeline_parallel_size == 1,
        )
        # Steps sent to the workers and not yet turned into outputs, oldest first.
        self.batch_queue: collections.deque[tuple[SchedulerOutput, Callable[[], ModelRunnerOutput]]] = (
            collections.deque()
        )
        self.pipeline_stages = config.parallel.pipeline_parallel_size
        # Async scheduling keeps the next step queued behind the one running.
        self.max_batches_in_flight = self.pipeline_stages + int(self.scheduler.async_scheduling)
        self.structured_outputs = StructuredOutputManager(config.model)

    def add_request(self, request: EngineCoreRequest) -> None:
        scheduled = Request.from_engine_core_request(request)
        constraint = request.sampling_params.structured_outputs
        if constraint is not None:
            scheduled.grammar = self.structured_outputs.grammar_for(constraint, request.eos_token_id)
        self.scheduler.add_request(scheduled)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def stop_sequence(self, request_id: str, index: int, stop_reason: str) -> None:
        """The front end matched a stop string: finish that sequence and free its blocks."""
        self.scheduler.stop_sequence(request_id, index, stop_reason)

    def step(self) -> EngineCoreOutputs:
        """Schedule, run the model, and turn sampled tokens into per-request outputs.

        With pipeline stages, up to pipeline_parallel_size steps are in flight at once (the batch
        queue), so that every stage has work; with async scheduling one more, the next step planned
        while the current one runs. A call then returns the outputs of the oldest step once it is
        done, or none while it only filled the queue. Requests that scheduling finished without
        running them (ignored, or never fitting) are reported by the call that scheduled them, first.
        """
        finished_outputs: list[EngineCoreOutput] = []
        if (
            len(self.batch_queue) < self.max_batches_in_flight
            and self.scheduler.has_unfinished_requests()
            and (not self.batch_queue or self._may_schedule_ahead())
        ):
            scheduled = self.scheduler.schedule()
            finished_outputs = scheduled.finished_outputs
            scheduler_output = scheduled.scheduler_output
            if _has_work(scheduler_output):
                # Rows without a grammar pay nothing: no scan at all until a request had one.
                rows = (
                    self.scheduler.grammar_rows(scheduler_output)
                    if self.structured_outputs.num_requests
                    else []
                )
                masks = self.structured_outputs.start_bitmask(rows)
                self.batch_queue.append(
                    (scheduler_output, self.executor.execute_model_async(scheduler_output, masks))
                )
                if len(self.batch_queue) < self.max_batches_in_flight and self._may_schedule_ahead():
                    return EngineCoreOutputs(outputs=finished_outputs, scheduler_stats=self.make_stats())
        if not self.batch_queue:
            self._wait_for_grammars()
            return EngineCoreOutputs(outputs=finished_outputs, scheduler_stats=self.make_stats())
        scheduler_output, wait_for_output = self.batch_queue.popleft()
        result = self.scheduler.update_from_output(scheduler_output, wait_for_output())
        result.outputs = finished_outputs + result.outputs
        if result.scheduler_stats is not None:
            self.structured_outputs.add_stats(result.scheduler_stats)
        return result

    def _may_schedule_ahead(self) -> bool:
        """Whether a step may be scheduled while others are in flight: always between pipeline
        stages (their batches hold disjoint requests), with async scheduling when every running
        request can run on placeholders."""
        return self.pipeline_stages > 1 or self.scheduler.may_schedule_ahead()

    def make_stats(self) -> SchedulerStats:
        return self.structured_outputs.add_stats(self.scheduler.make_stats())

    def _wait_for_grammars(self) -> None:
        """Nothing ran: if requests wait for their grammars, wait a moment for one to compile
        rather than return at once (the step loop would spin, sending empty outputs)."""
        compiling = [r.grammar for r in self.scheduler.waiting if r.waits_for_grammar]
        if compiling:
            concurrent.futures.wait(compiling, GRAMMAR_WAIT_S, concurrent.futures.FIRST_COMPLETED)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def get_stats(self) -> SchedulerStats:
        return self.make_stats()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; False (nothing changed) while any request holds blocks."""
        return self.scheduler.reset_prefix_cache()

    def prefix_cache_summary(self) -> bytes:
        """The prefix cache's block hashes, compact (`BlockPool.cached_hash_summary`), for routing."""
        return self.scheduler.prefix_cache_summary()

    def collective_rpc(self, method: str, args: Sequence[Any] = ()) -> list[Any]:
        """Call a Worker method on every rank (diagnostics: KV cache shapes, forward timings)."""
        return self.executor.collective_rpc(method, tuple(args))

    def add_lora(self, lora: LoRARequest | list[Any]) -> bool:
        """Read a LoRA adapter into every worker's host cache; False if they held it already.
        (A LoRARequest arrives from a client process as msgpack's list of its fields.)"""
        lora = msgspec.convert(lora, LoRARequest)
        return any(self.executor.collective_rpc("add_lora", (lora,)))

    def remove_lora(self, lora_int_id: int) -> bool:
        """Drop a LoRA adapter from every worker's host cache and its slot; False if no worker held it."""
        if self.scheduler.lora_slots is not None:
            self.scheduler.lora_slots.forget(lora_int_id)
        return any(self.executor.collective_rpc("remove_lora", (lora_int_id,)))

    def list_loras(self) -> list[int]:
        """The ids of the LoRA adapters in the workers' host caches."""
        return self.executor.collective_rpc("list_loras")[0]

    def check_health(self) -> None:
        """Raises if a worker is gone."""
        self.executor.check_health()

    def shutdown(self) -> None:
        self.structured_outputs.shutdown()
        self.executor.shutdown()


def _has_work(scheduler_output: SchedulerOutput) -> bool:
    """Even a step that runs no tokens may carry swaps and dropped sequences the workers must apply."""
    return bool(
        scheduler_output.total_num_scheduled_tokens
        or scheduler_output.has_block_moves
        or scheduler_output.finished_seq_ids
    )
