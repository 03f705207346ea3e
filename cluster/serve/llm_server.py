"""The Ray Serve deployments that hold one `AsyncLLMEngine` per replica.

`LLMServer` serves the OpenAI app itself over its own engine (the app of `cluster.openai.app`, as
`raypage api-server` builds it): a streamed token crosses no Ray hop between the HTTP server and the
engine. `HandleLLMServer` is the same replica without the app, for the separate-ingress shape: the
`OpenAIIngress` deployment streams a request's outputs from it with
`handle.options(stream=True).generate.remote(...)`.

Serve calls `check_health` every `health_check_period_s`: once the engine is dead (a worker killed,
a node gone) it raises, and after a few failures Serve replaces the replica with one holding a new
engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any, TypedDict

from fastapi import FastAPI
from ray import serve

from cluster.metrics import LoggingStatLogger, PrometheusStatLogger
from cluster.openai.app import ServerSettings, build_app, log_stats_periodically
from cluster.serve.adapters import ReplicaAdapters
from cluster.serve.niceness import set_niceness
from cluster.serve.routing import routing_stats
from engine.config import EngineConfig
from engine.config_resolve import resolve_engine_config
from engine.frontend.async_llm_engine import AsyncLLMEngine
from engine.frontend.input_processor import PromptType
from engine.lora.request import LoRARequest
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams


class EngineState(TypedDict):
    """What the separate ingress polls for its /metrics route."""

    errored: bool
    stats: dict[str, Any] | None  # the scheduler's latest counters; None once the engine is dead
    metrics: bytes  # this replica's Prometheus text: request counters, latency histograms, gauges


class EngineReplica:
    """One engine per replica. With the ray executor its workers go into the replica's placement
    group (worker rank i in bundle i), which `build_app` asks Serve to reserve for the replica."""

    async def __init__(
        self,
        engine_settings: dict[str, Any],
        settings: ServerSettings,
        stream_batch_interval_s: float = 0.0,
        niceness: int | None = None,
        max_adapters: int = 1,
    ) -> None:
        self._settings = settings
        self._stream_batch_interval_s = stream_batch_interval_s
        if niceness is not None:
            # Ray starts its workers at 15, like Serve's controller and proxies, which on a small
            # machine then take the engine's CPU. Before the engine starts: its core inherits it.
            set_niceness(niceness)
        # Resolved here, once (the engine takes it as it is): the token-count histograms are bucketed
        # up to max_model_len.
        config = resolve_engine_config(EngineConfig.from_flat(**engine_settings))
        self._prometheus = PrometheusStatLogger(settings.served_model_names[0], config.model.max_model_len)
        log_stats = LoggingStatLogger()
        # Blocks this replica's event loop until the engine is ready: it has nothing to serve before.
        self.engine = AsyncLLMEngine.from_config(config, stat_loggers=[self._prometheus, log_stats])
        # The adapters the separate ingress's requests name (the engine-ingress app keeps its own).
        self._adapters = ReplicaAdapters(self.engine, max_adapters)
        self._log_task: asyncio.Task | None = None
        if settings.log_stats_interval > 0:
            self._log_task = asyncio.create_task(
                log_stats_periodically(self.engine, log_stats, settings.log_stats_interval)
            )

    async def generate(
        self,
        prompt: PromptType,
        sampling_params: SamplingParams,
        request_id: str,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> AsyncIterator[list[RequestOutput]]:
        """The request's outputs, in batches: the first alone, then those produced within each
        stream-batch interval together, so that a streamed token is not one Ray message of its own
        per hop (each costs CPU that the forward pass needs). When the caller stops listening (a
        closed stream, a cancelled request, a client disconnect) Serve cancels this generator, which
        aborts the request. An adapter (`lora_request`) is loaded on this replica first if need be."""
        if lora_request is not None:
            lora_request = await self._adapters.local(lora_request)
        batch: list[RequestOutput] = []
        flush_at = 0.0  # the first output goes out at once
        # aclosing: the engine's stream is closed (and the request aborted) at once, not at collection.
        async with contextlib.aclosing(
            self.engine.generate(prompt, sampling_params, request_id, priority, lora_request=lora_request)
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

    async def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load an adapter on this replica (the ingress's runtime load, which checks it here);
        ValueError naming the adapter and the field when it is bad."""
        await self._adapters.local(lora_request)
        return True

    async def list_loras(self) -> list[int]:
        """The ids of the adapters this replica's engine holds."""
        return await self.engine.list_loras()

    async def get_state(self) -> EngineState:
        errored = self.engine.errored
        stats = None
        if not errored:
            await self._prometheus.refresh(self.engine)
            stats = self.engine.get_stats()
        return EngineState(errored=errored, stats=stats, metrics=self._prometheus.render())

    def __del__(self) -> None:
        # Serve calls this when it stops the replica (raypage serve's SIGTERM, a replacement, a
        # scale-down) once its requests in flight have finished (if drain_timeout_s passes first,
        # Serve kills the replica instead): anything left ends with finish_reason "abort", and the
        # engine's core process and workers go with it.
        # A replica whose engine failed to start has neither attribute.
        if getattr(self, "_log_task", None) is not None:
            self._log_task.cancel()
        if hasattr(self, "engine"):
            self.engine.abort_all()
            self.engine.shutdown()


class OpenAIEngineReplica(EngineReplica):
    """An engine replica that is also the HTTP front door: OpenAI's routes, /health (503 once the
    engine is dead), and /metrics from this replica's own stat logger, as `raypage api-server`."""

    async def __serve_build_asgi_app__(self) -> FastAPI:
        # Serve calls this on the replica's event loop once the constructor has run. The throughput
        # log task is the constructor's, so the app gets no `log_stats` of its own.
        return build_app(self.engine, self._settings, prometheus=self._prometheus)


class RoutedEngineReplica(EngineReplica):
    """An engine replica behind a separate ingress, whose router Serve keeps informed of what the
    replica's prefix cache holds and of its load (`cluster.serve.routing`)."""

    async def record_routing_stats(self) -> dict[str, Any]:
        """Serve's routing-stats hook, called every routing_stats_period_s."""
        summary = await self.engine.prefix_cache_summary()
        return routing_stats(summary, self.engine.get_stats(), await self._adapters.names())


LLMServer = serve.deployment(name="LLMServer")(serve.ingress()(OpenAIEngineReplica))
HandleLLMServer = serve.deployment(name="LLMServer")(RoutedEngineReplica)
