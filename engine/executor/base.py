"""The interface every executor shares, whatever runs its workers (this process, subprocesses, Ray)."""

from __future__ import annotations

import abc
import time
from collections.abc import Callable
from typing import Any

from engine.config import EngineConfig
from engine.outputs import ModelRunnerOutput, PendingBitmask, SchedulerOutput

HEALTH_TIMEOUT_S = 30.0  # a live worker that does not answer check_health within this is hung


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

    @abc.abstractmethod
    def _init_executor(self) -> None:
        """Start the workers, load the model."""

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
        deadline = None if timeout is None else time.monotonic() + timeout
        return self._call_workers(method, args, kwargs or {}, deadline)

    @abc.abstractmethod
    def _call_workers(
        self, method: str, args: tuple, kwargs: dict[str, Any], deadline: float | None
    ) -> list[Any]:
        """collective_rpc's work: `deadline` is a time.monotonic() value, or None for no limit."""

    def initialize_kv_cache(self) -> tuple[int, int]:
        """Size the device and host caches (the smallest worker decides, so that one scheduler drives
        them all) and allocate them; returns (device blocks, host swap blocks)."""
        sizes = self.collective_rpc("determine_num_kv_blocks")
        num_blocks, num_cpu_blocks = min(size[0] for size in sizes), min(size[1] for size in sizes)
        self.collective_rpc("initialize_cache", (num_blocks, num_cpu_blocks))
        return num_blocks, num_cpu_blocks

    def execute_model_async(
        self, scheduler_output: SchedulerOutput, grammar_bitmask: PendingBitmask | None = None
    ) -> Callable[[], ModelRunnerOutput]:
        """Start a step; the returned callable waits for its output. Executors whose workers run
        elsewhere return at once, so that pipeline stages overlap. Steps must be waited for in the
        order they were started (the engine's batch queue does).

        `grammar_bitmask` is the step's grammar masks while they are being computed (structured
        outputs): a worker in this process takes them only when it samples, so that computing them
        overlaps the forward pass; executors that send the step elsewhere wait for them first."""
        wait_for_workers = self._start_step(scheduler_output, grammar_bitmask)
        # Only the last pipeline stage samples: the other ranks answer None.
        return lambda: next(output for output in wait_for_workers() if output is not None)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.execute_model_async(scheduler_output)()

    def _start_step(
        self, scheduler_output: SchedulerOutput, grammar_bitmask: PendingBitmask | None
    ) -> Callable[[], list[ModelRunnerOutput | None]]:
        """Send the step to every worker; the callable waits for their answers in rank order. This
        default runs it now, in this process: the masks go along still pending."""
        outputs = self.collective_rpc("execute_model", (scheduler_output, grammar_bitmask))
        return lambda: outputs

    @staticmethod
    def with_grammar_bitmask(
        scheduler_output: SchedulerOutput, grammar_bitmask: PendingBitmask | None
    ) -> SchedulerOutput:
        """The step with its grammar masks in it, for an executor that sends it elsewhere (it waits
        for them)."""
        if grammar_bitmask is not None:
            scheduler_output.grammar_bitmask = grammar_bitmask.result()
        return scheduler_output

    def check_health(self) -> None:
        """Raises EngineDeadError when a worker died, TimeoutError when a live one does not answer."""
        self.collective_rpc("check_health", timeout=HEALTH_TIMEOUT_S)

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Stop the workers; safe to call twice."""
