"""The interface every executor shares, whatever runs its workers (this process, subprocesses, Ray)."""

from __future__ import annotations

import abc
from collections.abc import Callable
from typing import Any

from engine.config import EngineConfig
from engine.outputs import ModelRunnerOutput, SchedulerOutput


class Executor(abc.ABC):
    """Drives the workers of one engine through remote calls by method name."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self._init_executor()

    @staticmethod
    def get_class(config: EngineConfig) -> type[Executor]:
        parallel = config.parallel
        backend = parallel.executor_backend
        if backend == "uni":
            if parallel.world_size > 1:
                raise ValueError(
                    f"distributed_executor_backend='uni' runs one worker, but tensor_parallel_size x "
                    f"pipeline_parallel_size = {parallel.world_size}"
                )
            from engine.executor.uniproc import UniProcExecutor

            return UniProcExecutor
        if backend == "mp":
            from engine.executor.multiproc import MultiprocExecutor

            return MultiprocExecutor
        from engine.executor.ray_distributed import RayDistributedExecutor

        return RayDistributedExecutor

    @staticmethod
    def inherit_caller_context(config: EngineConfig) -> EngineConfig:
        """The config for an engine core started from this process in another one: executors whose
        workers depend on where the caller runs (its Ray cluster, its placement group) record it here."""
        return config

    @abc.abstractmethod
    def _init_executor(self) -> None:
        """Start the workers, load the model."""

    @abc.abstractmethod
    def collective_rpc(
        self,
        method: str,
        args: tuple = (),
        kwargs: dict[str, Any] | None = None,
        timeout: float | None = None,
    ) -> list[Any]:
        """Call `method` on every worker; their results in rank order.

        With workers in other processes, a worker's exception comes back as a RuntimeError naming its
        rank, a dead worker raises EngineDeadError, and `timeout` (seconds; None: no limit) bounds the
        wait with a TimeoutError. An in-process worker's exception propagates as it is."""

    def initialize_kv_cache(self) -> tuple[int, int]:
        """Size the device and host caches (the smallest worker decides, so that one scheduler drives
        them all) and allocate them; returns (device blocks, host swap blocks)."""
        sizes = self.collective_rpc("determine_num_kv_blocks")
        num_blocks, num_cpu_blocks = min(size[0] for size in sizes), min(size[1] for size in sizes)
        self.collective_rpc("initialize_cache", (num_blocks, num_cpu_blocks))
        return num_blocks, num_cpu_blocks

    def execute_model_async(self, scheduler_output: SchedulerOutput) -> Callable[[], ModelRunnerOutput]:
        """Start a step; the returned callable waits for its output. Executors whose workers run
        elsewhere return at once, so that pipeline stages overlap; this default runs the step now."""
        output = self.execute_model(scheduler_output)
        return lambda: output

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        outputs = self.collective_rpc("execute_model", (scheduler_output,))
        return next(output for output in outputs if output is not None)

    def check_health(self) -> None:
        self.collective_rpc("check_health")

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Stop the workers; safe to call twice."""
