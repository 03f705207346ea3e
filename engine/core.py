"""EngineCore: the scheduler and the executor, driven one step at a time."""

from __future__ import annotations

import logging

from engine.config import EngineConfig
from engine.executor.base import Executor
from engine.outputs import EngineCoreOutputs, EngineCoreRequest, ModelRunnerOutput, SchedulerStats
from engine.request import Request, RequestStatus
from engine.scheduler import Scheduler

logger = logging.getLogger(__name__)


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
        self.scheduler = Scheduler(config.scheduler, config.cache, num_blocks, max_model_len, num_cpu_blocks)

    def add_request(self, request: EngineCoreRequest) -> None:
        self.scheduler.add_request(Request.from_engine_core_request(request))

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def stop_sequence(self, request_id: str, index: int, stop_reason: str) -> None:
        """The front end matched a stop string: finish that sequence and free its blocks."""
        self.scheduler.stop_sequence(request_id, index, stop_reason)

    def step(self) -> EngineCoreOutputs:
        """Schedule, run the model, and turn sampled tokens into per-request outputs."""
        if not self.scheduler.has_unfinished_requests():
            return EngineCoreOutputs(scheduler_stats=self.scheduler.make_stats())
        scheduler_output = self.scheduler.schedule()
        # Even a step that runs no tokens may carry swaps and dropped sequences the workers must apply.
        if (
            scheduler_output.total_num_scheduled_tokens
            or scheduler_output.has_block_moves
            or scheduler_output.finished_seq_ids
        ):
            runner_output = self.executor.execute_model(scheduler_output)
        else:
            runner_output = ModelRunnerOutput(seq_ids=[], sampled_token_ids=[])
        return self.scheduler.update_from_output(scheduler_output, runner_output)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def get_stats(self) -> SchedulerStats:
        return self.scheduler.make_stats()

    def check_health(self) -> None:
        """Raises if a worker is gone."""
        self.executor.check_health()

    def shutdown(self) -> None:
        self.executor.shutdown()
