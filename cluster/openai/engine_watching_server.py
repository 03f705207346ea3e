"""The uvicorn server of `raypage api-server`, which exits when its engine dies.

A dead engine core (or a dead worker, which kills the core's engine) cannot come back within the
process, so serving 503s forever would only hide the fault from whatever supervises the server. As
vLLM's api server does (its watchdog), it stops; here with a non-zero status, so that a supervisor
(systemd, Kubernetes) restarts it and its log says why. Until then, for ENGINE_DEATH_EXIT_DELAY_S,
requests and /health answer 503 with the reason.
"""

from __future__ import annotations

import logging
import time

import uvicorn

from cluster.openai.drain import DrainingServer, DrainState
from engine.exceptions import EngineDeadError
from engine.frontend.async_llm_engine import AsyncLLMEngine

logger = logging.getLogger(__name__)

# vLLM's watchdog looks every 5 s; a fixed delay from the death on gives clients, load balancers and
# health probes the same window to see the 503 and its reason.
ENGINE_DEATH_EXIT_DELAY_S = 5.0
# uvicorn ticks every 0.1 s; the engine is looked at every tenth tick.
TICKS_PER_CHECK = 10


class EngineWatchingServer(DrainingServer):
    """The draining server, which also shuts down gracefully ENGINE_DEATH_EXIT_DELAY_S after its
    engine dies; `engine_death` then holds the reason."""

    def __init__(
        self, config: uvicorn.Config, state: DrainState, engine: AsyncLLMEngine, drain_timeout_s: float
    ) -> None:
        super().__init__(config, state, engine, drain_timeout_s)
        self.engine = engine
        self.engine_death: EngineDeadError | None = None
        self._died_at = 0.0

    async def on_tick(self, counter: int) -> bool:
        if self.engine_death is None and counter % TICKS_PER_CHECK == 0:
            try:
                await self.engine.check_health()
            except EngineDeadError as exc:
                self.engine_death, self._died_at = exc, time.monotonic()
                logger.error("%s; the server exits in %g s", exc, ENGINE_DEATH_EXIT_DELAY_S)
        if self.engine_death is not None and time.monotonic() - self._died_at >= ENGINE_DEATH_EXIT_DELAY_S:
            return True
        return await super().on_tick(counter)
