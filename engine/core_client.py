"""How a front end talks to an EngineCore. This build has the in-process client."""

from __future__ import annotations

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.outputs import EngineCoreOutputs, EngineCoreRequest, SchedulerStats


class InprocClient:
    """Runs the EngineCore in the caller's process and thread: each `get_output` is one step."""

    def __init__(self, config: EngineConfig) -> None:
        self.engine_core = EngineCore(config)

    def add_request(self, request: EngineCoreRequest) -> None:
        self.engine_core.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.engine_core.abort_requests(request_ids)

    def stop_sequence(self, request_id: str, index: int, stop_reason: str) -> None:
        self.engine_core.stop_sequence(request_id, index, stop_reason)

    def get_output(self) -> EngineCoreOutputs:
        return self.engine_core.step()

    def get_stats(self) -> SchedulerStats:
        return self.engine_core.get_stats()

    def shutdown(self) -> None:
        self.engine_core.shutdown()
