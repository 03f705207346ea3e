"""One worker, in this process: no serialization, no extra processes."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from typing import Any, TypeVar

from engine.executor.base import Executor
from engine.outputs import ModelRunnerOutput, PendingBitmask, SchedulerOutput
from engine.worker.worker import Worker

T = TypeVar("T")


class UniProcExecutor(Executor):
    """Runs a single Worker in-process.

    With async scheduling the worker lives on a thread of its own, so that the core schedules the
    next step while this one runs: every call reaches the worker through that thread, in order
    (its device, set at init, is the thread's)."""

    def _init_executor(self) -> None:
        self._thread = (
            concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="RaypageWorker")
            if self.config.scheduler.async_scheduling
            else None
        )
        self.worker = self._run(Worker, self.config)
        self._run(self.worker.init_device)
        self._run(self.worker.load_model)

    def _run(self, function: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        if self._thread is None:
            return function(*args, **kwargs)
        return self._thread.submit(function, *args, **kwargs).result()

    def _call_workers(
        self, method: str, args: tuple, kwargs: dict[str, Any], deadline: float | None
    ) -> list[Any]:
        # In-process: the call returns or raises here, so the deadline has nothing to bound.
        return [self._run(getattr(self.worker, method), *args, **kwargs)]

    def _start_step(
        self, scheduler_output: SchedulerOutput, grammar_bitmask: PendingBitmask | None
    ) -> Callable[[], list[ModelRunnerOutput | None]]:
        if self._thread is None:
            return super()._start_step(scheduler_output, grammar_bitmask)
        step = self._thread.submit(self.worker.execute_model, scheduler_output, grammar_bitmask)
        return lambda: [step.result()]

    def shutdown(self) -> None:
        """The worker goes with the executor; its thread, if any, ends after the step it runs."""
        if self._thread is not None:
            self._thread.shutdown(wait=True)
