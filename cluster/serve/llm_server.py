"""`LLMServer`: the Ray Serve deployment that holds one `AsyncLLMEngine` per replica.

A thin shim over the engine, so that the ingress (and any other caller with a `DeploymentHandle`)
streams a request's outputs with `handle.options(stream=True).generate.remote(...)`. Serve calls
`check_health` every `health_check_period_s`: once the engine is dead (a worker killed, a node
gone) it raises, and after a few failures Serve replaces the replica with one holding a new engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any, TypedDict

from ray import serve

from cluster.metrics import LoggingStatLogger, PrometheusStatLogger
from cluster.openai.app import log_stats_periodically
from engine.async_llm_engine import AsyncLLMEngine
from engine.config import EngineConfig
from engine.config_resolve import resolve_engine_config
from engine.input_processor import PromptType
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams


class EngineState(TypedDict):
    """What the ingress polls for its /metrics route."""

    errored: bool
    stats: dict[str, Any] | None  # the scheduler's latest counters; None once the engine is dead
    metrics: bytes  # this replica's Prometheus text: request counters, latency histograms, gauges


@serve.deployment(name="LLMServer")
class LLMServer:
    """One engine per replica. With the ray executor its workers go into the replica's placement
    group (worker rank i in bundle i), which `build_app` asks Serve to reserve for the replica."""

    async def __init__(
        self,
        engine_settings: dict[str, Any],
        served_model_name: str,
        log_stats_interval: float,
        stream_batch_interval_s: float = 0.0,
    ) -> None:
        self._stream_batch_interval_s = stream_batch_interval_s
        # Resolved here, once (the engine takes it as it is): the token-count histograms are bucketed
        # up to max_model_len.
        config = resolve_engine_config(EngineConfig.from_flat(**engine_settings))
        self._prometheus = PrometheusStatLogger(served_model_name, config.model.max_model_len)
        log_stats = LoggingStatLogger()
        # Blocks this replica's event loop until the engine is ready: it has nothing to serve before.
        self.engine = AsyncLLMEngine.from_config(config, stat_loggers=[self._prometheus, log_stats])
        self._log_task: asyncio.Task | None = None
        if log_stats_interval > 0:
            self._log_task = asyncio.create_task(
                log_stats_periodically(self.engine, log_stats, log_stats_interval)
            )

    async def generate(
        self, prompt: PromptType, sampling_params: SamplingParams, request_id: str, priority: int = 0
    ) -> AsyncIterator[list[RequestOutput]]:
        """The request's outputs, in batches: the first alone, then those produced within each
        stream-batch interval together, so that a streamed token is not one Ray message of its own
        per hop (each costs CPU that the forward pass needs). When the caller stops listening (a
        closed stream, a cancelled request, a client disconnect) Serve cancels this generator, which
        aborts the request."""
        batch: list[RequestOutput] = []
        flush_at = 0.0  # the first output goes out at once
        # aclosing: the engine's stream is closed (and the request aborted) at once, not at collection.
        async with contextlib.aclosing(
            self.engine.generate(prompt, sampling_params, request_id, priority)
        ) as outputs:
            async for output in outputs:
                batch.append(output)
                now = time.monotonic()
                if output.finished or now >= flush_at:
                    yield batch
                    batch = []
                    flush_at = now + self._stream_batch_interval_s

    async def check_health(self) -> None:
        """Serve's health-check hook: raises EngineDeadError once the engine cannot serve."""
        await self.engine.check_health()

    async def reset_prefix_cache(self) -> bool:
        """Forget this replica's cached prefixes; False while a request holds KV blocks."""
        return await self.engine.reset_prefix_cache()

    def get_state(self) -> EngineState:
        errored = self.engine.errored
        stats = None if errored else self.engine.get_stats()
        return EngineState(errored=errored, stats=stats, metrics=self._prometheus.render())

    def __del__(self) -> None:
        # Serve calls this when it stops the replica: the engine's core process and workers go with it.
        # A replica whose engine failed to start has neither attribute.
        if getattr(self, "_log_task", None) is not None:
            self._log_task.cancel()
        if hasattr(self, "engine"):
            self.engine.shutdown()
