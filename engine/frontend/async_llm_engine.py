"""AsyncLLMEngine: the asyncio engine API a server builds on.

`async for output in engine.generate(prompt, params, request_id)` streams one request's outputs.
The EngineCore runs in its own process (an asyncio EngineCoreClient); in this process one output-handler task
takes each batch of core outputs, detokenizes it (OutputProcessor), sends stop strings it matched
back to the core, feeds each request's asyncio queue, and hands the batch's stats to the stat
loggers. A consumer that stops listening (cancelled task, closed generator, client disconnect)
aborts its request in the core, which frees its KV blocks at once.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Sequence
from typing import Any

import msgspec

from engine.config import EngineConfig
from engine.config_resolve import resolve_engine_config
from engine.exceptions import EngineDeadError, EngineOverloadedError
from engine.frontend.input_processor import PromptType
from engine.frontend.llm_engine import build_front_end
from engine.frontend.output_processor import OutputProcessor
from engine.frontend.stats import FinishedRequestStats, IterationStats, StatLogger
from engine.lora.request import LoRARequest
from engine.outputs import EngineCoreOutputs, RequestOutput, SchedulerStats
from engine.process.core_client import DEFAULT_READY_TIMEOUT_S, EngineCoreClient
from engine.sampling_params import BeamSearchParams, SamplingParams

logger = logging.getLogger(__name__)


class AsyncLLMEngine:
    """Streams requests' outputs to asyncio consumers, over an EngineCore in its own process.

    `config` is resolved here unless it already is (model path, dtype, max_model_len); the
    tokenizer and the input processor (tokenization, validation: what a server needs for token
    counting) live in this process. Construction blocks until the core process is ready.
    """

    def __init__(
        self,
        config: EngineConfig,
        stat_loggers: Sequence[StatLogger] = (),
        ready_timeout_s: float = DEFAULT_READY_TIMEOUT_S,
    ) -> None:
        self.config = resolve_engine_config(config)
        # The core process starts first and loads the model while this one loads the tokenizer.
        self.engine_core = EngineCoreClient.make_client(
            self.config,
            multiprocess=True,
            asyncio_mode=True,
            ready_timeout_s=ready_timeout_s,
            wait_until_ready=False,
        )
        try:
            _, self.tokenizer, self.input_processor = build_front_end(self.config)
        except BaseException:
            self.engine_core.shutdown()
            raise
        self.engine_core.wait_until_ready()
        self.output_processor = OutputProcessor(self.tokenizer)
        self.stat_loggers = list(stat_loggers)
        self._latest_stats: SchedulerStats = self.engine_core.initial_stats
        self._queues: dict[str, asyncio.Queue[RequestOutput | EngineDeadError]] = {}
        # Requests aborted since the last batch: reported with the next one.
        self._aborted_stats: list[FinishedRequestStats] = []
        self._handler: asyncio.Task | None = None
        self._handler_loop: asyncio.AbstractEventLoop | None = None
        self._dead_error: EngineDeadError | None = None

    @classmethod
    def from_config(cls, config: EngineConfig, stat_loggers: Sequence[StatLogger] = ()) -> AsyncLLMEngine:
        return cls(config, stat_loggers)

    async def generate(
        self,
        prompt: PromptType,
        sampling_params: SamplingParams | BeamSearchParams,
        request_id: str,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """The request's outputs, per `sampling_params.output_kind`; the last has finished=True.

        Invalid input raises ValueError from the first `__anext__`, before anything is queued; a
        dead engine raises EngineDeadError. Cancelling the consuming task or closing the iterator
        before the end aborts the request.
        """
        queue = self._add_request(prompt, sampling_params, request_id, priority, lora_request)
        finished = False
        try:
            while not finished:
                output = await queue.get()
                if isinstance(output, EngineDeadError):
                    raise output
                finished = output.finished
                yield output
        finally:
            if not finished:
                self._abort(request_id)

    async def abort(self, request_id: str) -> None:
        """Abort a request: its blocks are freed, and its stream ends with finish_reason "abort".
        Unknown or finished ids are ignored."""
        self._abort(request_id)

    async def check_health(self) -> None:
        """Raises EngineDeadError when the engine core is gone."""
        self._check_alive()

    async def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; False (nothing changed) while a request holds KV blocks."""
        self._check_alive()
        return await self.engine_core.reset_prefix_cache_async()

    async def add_lora(self, lora_request: LoRARequest) -> bool:
        """Check a LoRA adapter (ValueError naming it and the field) and read it into the workers'
        host caches; False if they held it already."""
        self._check_alive()
        self.input_processor.check_lora(lora_request)
        return await self.engine_core.add_lora_async(lora_request)

    async def remove_lora(self, lora_int_id: int) -> bool:
        """Drop a LoRA adapter from the workers' host caches; False if none held it."""
        self._check_alive()
        self.input_processor.forget_lora(lora_int_id)
        return await self.engine_core.remove_lora_async(lora_int_id)

    async def list_loras(self) -> list[int]:
        """The ids of the LoRA adapters in the workers' host caches."""
        self._check_alive()
        return await self.engine_core.list_loras_async()

    async def prefix_cache_summary(self) -> bytes:
        """The prefix cache's block hashes, compact (`BlockPool.cached_hash_summary`): what a Serve
        router matches a prompt's chain hashes against."""
        self._check_alive()
        return await self.engine_core.call_utility_async("prefix_cache_summary", result_type=bytes)

    @property
    def errored(self) -> bool:
        return self._dead_error is not None or self.engine_core.errored

    def get_stats(self) -> dict[str, Any]:
        """The scheduler's latest counters (sent by the core with every batch of outputs)."""
        return msgspec.structs.asdict(self._latest_stats)

    def shutdown(self) -> None:
        """Stop the core process; pending requests fail with EngineDeadError. Safe to call twice."""
        if (
            self._handler is not None
            and self._handler_loop is not None
            and not self._handler_loop.is_closed()
        ):
            self._handler.cancel()
        self._fail_all(EngineDeadError("the engine was shut down"))
        self.engine_core.shutdown()

    # ---- requests in ----------------------------------------------------------------------------

    def _add_request(
        self,
        prompt: PromptType,
        params: SamplingParams | BeamSearchParams,
        request_id: str,
        priority: int,
        lora_request: LoRARequest | None,
    ) -> asyncio.Queue[RequestOutput | EngineDeadError]:
        self._check_alive()
        if request_id in self.output_processor.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        self._check_admission()
        request, prompt_text = self.input_processor.process(
            request_id, prompt, params, priority=priority, lora_request=lora_request
        )
        self._start_output_handler()
        queue: asyncio.Queue[RequestOutput | EngineDeadError] = asyncio.Queue()
        self.output_processor.add_request(request, prompt_text)
        self._queues[request_id] = queue
        try:
            self.engine_core.add_request(request)
        except BaseException:
            self.output_processor.abort_requests([request_id])
            del self._queues[request_id]
            raise
        return queue

    def _check_admission(self) -> None:
        """Refuse a request past max_num_seqs + max_waiting_requests unfinished ones. Counted here,
        from what this front end sent and has not seen finish, so the count is exact whatever the
        core process has got to; the core's own waiting count lags a step behind."""
        limit = self.config.scheduler.max_admitted_requests
        if limit is not None and len(self.output_processor.requests) >= limit:
            scheduler = self.config.scheduler
            raise EngineOverloadedError(
                f"The server is overloaded: {limit} requests are already running or waiting "
                f"(max_num_seqs={scheduler.max_num_seqs} + max_waiting_requests="
                f"{limit - scheduler.max_num_seqs}). Please retry later."
            )

    def abort_all(self) -> None:
        """Abort every unfinished request: each stream ends with finish_reason "abort" (a draining
        server's last step)."""
        self._abort_all(list(self.output_processor.requests))

    @property
    def num_unfinished_requests(self) -> int:
        return len(self.output_processor.requests)

    def _abort(self, request_id: str) -> None:
        outputs = self.output_processor.abort_requests([request_id], self._aborted_stats)
        queue = self._queues.pop(request_id, None)
        if not outputs:
            return
        if queue is not None:
            queue.put_nowait(outputs[0])  # a consumer still listening sees its stream end
        self.engine_core.abort_requests([request_id])

    def _check_alive(self) -> None:
        if self._dead_error is not None:
            raise self._dead_error
        self.engine_core.check_alive()

    # ---- outputs out ----------------------------------------------------------------------------

    def _start_output_handler(self) -> None:
        loop = asyncio.get_running_loop()
        if self._handler_loop is loop:
            return
        # Requests of an earlier event loop (a finished asyncio.run) can never be consumed now.
        self._abort_all(list(self._queues))
        self._handler_loop = loop
        self._handler = loop.create_task(self._run_output_handler(), name="AsyncLLMEngine.output_handler")

    async def _run_output_handler(self) -> None:
        try:
            while True:
                self._process_outputs(await self.engine_core.get_output_async())
        except EngineDeadError as exc:
            self._fail_all(exc)
        except Exception as exc:
            # A bug on this side: fail every request loudly rather than leave consumers waiting.
            logger.exception("AsyncLLMEngine output handler failed")
            self._fail_all(EngineDeadError(f"the output handler failed: {type(exc).__name__}: {exc}"))

    def _process_outputs(self, outputs: EngineCoreOutputs) -> None:
        stats = IterationStats() if self.stat_loggers else None
        if stats is not None:
            stats.finished_requests += self._aborted_stats
        self._aborted_stats.clear()
        results, stops = self.output_processor.process_outputs(outputs.outputs, stats)
        for stop in stops:
            self.engine_core.stop_sequence(stop.request_id, stop.index, stop.stop_reason)
        for result in results:
            queue = (
                self._queues.pop(result.request_id, None)
                if result.finished
                else self._queues.get(result.request_id)
            )
            if queue is not None:
                queue.put_nowait(result)
        if outputs.scheduler_stats is not None:
            self._latest_stats = outputs.scheduler_stats
        for stat_logger in self.stat_loggers:
            try:
                stat_logger.record(outputs.scheduler_stats, stats)
            except Exception:
                # Metrics must never take the engine down.
                logger.exception("stat logger %r failed", stat_logger)

    def _abort_all(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self._abort(request_id)

    def _fail_all(self, error: EngineDeadError) -> None:
        """The engine is dead: every pending request fails with `error`, and every later one."""
        self._dead_error = self._dead_error or error
        self.output_processor.abort_requests(list(self.output_processor.requests))
        for queue in self._queues.values():
            queue.put_nowait(error)
        self._queues.clear()
