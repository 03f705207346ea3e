"""One worker, in this process: no serialization, no extra processes."""

from __future__ import annotations

from typing import Any

from engine.executor.base import Executor
from engine.worker.worker import Worker


class UniProcExecutor(Executor):
    """Runs a single Worker in-process."""

    def _init_executor(self) -> None:
        self.worker = Worker(self.config)
        self.worker.init_device()
        self.worker.load_model()

    def _call_workers(
        self, method: str, args: tuple, kwargs: dict[str, Any], deadline: float | None
    ) -> list[Any]:
        # In-process: the call returns or raises here, so the deadline has nothing to bound.
        return [getattr(self.worker, method)(*args, **kwargs)]

    def shutdown(self) -> None:
        """Nothing runs outside this process; the worker goes with the executor."""
