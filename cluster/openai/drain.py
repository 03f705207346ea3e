"""Graceful drain of `raypage api-server`: after SIGTERM or SIGINT the server stops admitting, lets
the requests it has finish within `drain_timeout_s`, aborts the rest, then exits.

`DrainMiddleware` counts the HTTP requests in flight and, once draining, answers every new one with
503 (and `Retry-After`), /health included, whose body says the server is draining; /metrics stays
open. `DrainingServer` is uvicorn's server with the first signal turned into a drain instead of an
immediate stop (uvicorn would close its listening socket at once, and new clients would meet a
refused connection rather than an answer a load balancer understands).
"""

from __future__ import annotations

import asyncio
import logging
from http import HTTPStatus
from types import FrameType
from typing import Protocol

import uvicorn
from starlette.types import ASGIApp, Receive, Scope, Send

from cluster.openai.errors import error_response

logger = logging.getLogger(__name__)

# Seconds the aborted requests' responses get to reach their clients before the server stops.
ABORT_FLUSH_S = 5.0
# Probes and scrapes: never counted as in flight, and /metrics is served while draining.
_UNCOUNTED_PATHS = ("/health", "/metrics")


class DrainState:
    """Whether the server is draining, and how many HTTP requests are in flight."""

    def __init__(self) -> None:
        self.draining = False
        self._in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def enter(self) -> None:
        self._in_flight += 1
        self._idle.clear()

    def leave(self) -> None:
        self._in_flight -= 1
        if self._in_flight == 0:
            self._idle.set()

    async def wait_idle(self, timeout_s: float) -> bool:
        """True once no request is in flight; False if some still are after `timeout_s`."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except TimeoutError:
            return False
        return True


class DrainMiddleware:
    """Counts requests in flight; refuses new ones (503, Retry-After) while the server drains."""

    def __init__(self, app: ASGIApp, state: DrainState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope["path"] if scope["type"] == "http" else None  # None: lifespan events
        if self.state.draining and path not in (None, "/metrics"):
            message = "The server is draining: it finishes the requests it has and takes no new ones."
            await error_response(HTTPStatus.SERVICE_UNAVAILABLE, message)(scope, receive, send)
        elif path is None or path in _UNCOUNTED_PATHS:
            await self.app(scope, receive, send)
        else:
            self.state.enter()
            try:
                await self.app(scope, receive, send)
            finally:
                self.state.leave()


class Abortable(Protocol):
    """What the drain aborts when its time is up: the engine's unfinished requests."""

    def abort_all(self) -> None: ...

    @property
    def num_unfinished_requests(self) -> int: ...


class DrainingServer(uvicorn.Server):
    """uvicorn's server, whose first SIGTERM or SIGINT drains (see the module's docstring) and whose
    second stops it at once. It exits normally either way, so the process's status is 0."""

    def __init__(
        self, config: uvicorn.Config, state: DrainState, engine: Abortable, drain_timeout_s: float
    ) -> None:
        super().__init__(config)
        self._state = state
        self._engine = engine
        self._drain_timeout_s = drain_timeout_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task | None = None

    async def serve(self, sockets: list | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # A signal handler: it runs between two bytecodes of the event loop's thread, so it only
        # schedules. uvicorn's own records the signal to re-raise it after the shutdown, which
        # would end the process by that signal; this one leaves the exit status to the program.
        if self._loop is None or self._state.draining:
            self.should_exit = True
            self.force_exit = self._state.draining
            return
        self._state.draining = True
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        self._drain_task = asyncio.ensure_future(self._drain())

    async def _drain(self) -> None:
        logger.info(
            "draining: %d requests in flight get up to %g s to finish; new ones get 503",
            self._state.in_flight,
            self._drain_timeout_s,
        )
        if not await self._state.wait_idle(self._drain_timeout_s):
            logger.warning(
                "drain timeout (%g s): aborting %d unfinished requests",
                self._drain_timeout_s,
                self._engine.num_unfinished_requests,
            )
            self._engine.abort_all()
            await self._state.wait_idle(ABORT_FLUSH_S)
        logger.info("drained; stopping")
        self.should_exit = True
