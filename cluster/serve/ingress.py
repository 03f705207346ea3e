"""The OpenAI ingress deployment: the FastAPI app of `cluster.openai.app` over engine clients that
forward to the `LLMServer` deployments, one per model (a request's `model` picks it).

Tokenization, chat templates and validation run here, with a tokenizer and input processor built
from the same engine settings (the model files are local to every node); generation runs in an
LLMServer replica and streams back through `DeploymentHandle.options(stream=True)`. A request whose
replica fails mid-stream continues on another (`cluster.serve.failover`).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import AsyncIterator, Sequence
from typing import Any

from fastapi import FastAPI
from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from ray import serve
from ray.exceptions import RayActorError, RayTaskError
from ray.serve.exceptions import DeploymentUnavailableError, ReplicaUnavailableError
from ray.serve.handle import DeploymentHandle

from cluster.metrics import lora_request_counter
from cluster.openai.app import ServerSettings, build_app
from cluster.openai.engine_client import EngineClient
from cluster.openai.model_handlers import ServedModel
from cluster.openai.serving_models import LoRASources
from cluster.serve.failover import FailoverMetrics, FailoverSettings, NotResumableError, StreamProgress
from cluster.serve.llm_server import EngineState
from engine.config import EngineConfig
from engine.exceptions import EngineDeadError
from engine.frontend.detokenizer import backend_tokenizer
from engine.frontend.input_processor import PromptType
from engine.frontend.llm_engine import build_front_end
from engine.lora.request import LoRARequest
from engine.outputs import RequestOutput
from engine.sampling_params import BeamSearchParams, SamplingParams

logger = logging.getLogger(__name__)

# How often the ingress refreshes the engine state and metrics behind /metrics.
STATE_POLL_INTERVAL_S = 1.0
# Failures that mean the LLMServer replica (not the request) is gone.
_REPLICA_GONE = (RayActorError, ReplicaUnavailableError, DeploymentUnavailableError)
# Between a replica's failure and the request's resubmission, and between resubmissions: Serve's
# router may still offer the dead replica until it learns of its death.
FAILOVER_RETRY_INTERVAL_S = 0.5


class DeploymentEngineClient:
    """The app's `EngineClient` over an `LLMServer` deployment handle.

    Errors come back as the engine raised them (ValueError -> 400, EngineDeadError -> 503), not
    wrapped in Ray's exceptions; a replica that died is an EngineDeadError too.
    """

    def __init__(
        self,
        handle: DeploymentHandle,
        engine_settings: dict[str, Any],
        failover: FailoverSettings,
        failover_counters: tuple[Counter, Counter],
    ) -> None:
        self.config, self.tokenizer, self.input_processor = build_front_end(
            EngineConfig.from_flat(**engine_settings)
        )
        self._handle = handle
        self._state = EngineState(errored=False, stats={}, metrics=b"")
        self._failover = failover
        self._resumed, self._failed = failover_counters
        self._detokenizer_tokenizer = backend_tokenizer(self.tokenizer)

    async def generate(
        self,
        prompt: PromptType,
        sampling_params: SamplingParams | BeamSearchParams,
        request_id: str,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """The request's outputs from an LLMServer replica (one holding its adapter, if it has one);
        closing this early cancels the remote generator, which aborts the request there and frees its
        blocks. When the replica fails, the request continues on another (with failover on), or ends
        with EngineDeadError."""
        progress = StreamProgress(request_id, prompt, sampling_params, self._detokenizer_tokenizer)
        attempt_prompt, attempt_params, attempt_id = prompt, sampling_params, request_id
        loop = asyncio.get_running_loop()
        deadline: float | None = None  # set while the request waits for a replica to take it over
        for attempt in itertools.count(1):
            try:
                replica_stream = self._replica_stream(
                    attempt_prompt, attempt_params, attempt_id, priority, lora_request, deadline
                )
                # aclosing: leaving early (the client gone, a stop string found here) cancels the remote call.
                async with contextlib.aclosing(replica_stream) as outputs:
                    async for output in outputs:
                        if deadline is not None:
                            deadline = None
                            self._resumed.inc()
                        yield progress.deliver(output)
                        if progress.finished:
                            return
                return
            except TimeoutError:
                self._failed.inc()
                raise EngineDeadError(
                    f"request {request_id}: its LLMServer replica failed, and no healthy replica took it "
                    f"over within failover_timeout_s={self._failover.timeout_s:g} s"
                ) from None
            except EngineDeadError as error:
                if not self._failover.enabled:
                    raise
                deadline = deadline or loop.time() + self._failover.timeout_s
                try:
                    attempt_prompt, attempt_params = progress.resubmission()
                except NotResumableError:
                    self._failed.inc()
                    raise
                logger.warning(
                    "request %s: its LLMServer replica failed (%s) after %d tokens; resubmitting it",
                    request_id,
                    error,
                    len(progress.token_ids),
                )
                attempt_id = f"{request_id}-failover{attempt}"
                await asyncio.sleep(max(0.0, min(FAILOVER_RETRY_INTERVAL_S, deadline - loop.time())))

    async def _replica_stream(
        self,
        prompt: PromptType,
        sampling_params: SamplingParams | BeamSearchParams,
        request_id: str,
        priority: int,
        lora_request: LoRARequest | None,
        deadline: float | None,
    ) -> AsyncIterator[RequestOutput]:
        """One replica's outputs for the request; TimeoutError when its first batch has not come by
        `deadline` (loop time; None: no limit), the engine's error when the call fails."""
        stream = self._adapter_handle(lora_request, stream=True).generate.remote(
            prompt, sampling_params, request_id, priority, lora_request
        )
        finished = False
        try:
            if deadline is not None:
                timeout = deadline - asyncio.get_running_loop().time()
                first = await asyncio.wait_for(anext(stream, None), max(0.0, timeout))
                if first is None:
                    return
                for output in first:
                    finished = output.finished
                    yield output
            async for batch in stream:
                for output in batch:
                    finished = output.finished
                    yield output
        except TimeoutError:
            raise
        except Exception as exc:
            raise engine_error(exc) from None
        finally:
            if not finished:
                stream.cancel()

    def _adapter_handle(self, lora_request: LoRARequest | None, **options: Any) -> DeploymentHandle:
        """The handle for a call that runs with `lora_request`: its name is the Serve multiplexed model
        id, which the router matches against the adapters each replica holds."""
        if lora_request is not None:
            options["multiplexed_model_id"] = lora_request.lora_name
        return self._handle.options(**options)

    async def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load the adapter on one replica (which checks it: ValueError naming the adapter and the
        field when it is bad); the others load it when a request for it reaches them."""
        try:
            return await self._adapter_handle(lora_request).add_lora.remote(lora_request)
        except Exception as exc:
            raise engine_error(exc) from None

    async def remove_lora(self, lora_int_id: int) -> bool:
        """Nothing to do on the replicas, which number their adapters themselves: once no request
        names the adapter, each replica evicts it as its least recently used."""
        return True

    async def list_loras(self) -> list[int]:
        """The adapter ids of the replica the handle picks (each replica holds its own)."""
        return await self._call_replica("list_loras")

    async def check_health(self) -> None:
        await self._call_replica("check_health")

    async def reset_prefix_cache(self) -> bool:
        """Resets the cache of the replica the handle picks; with several, each keeps its own."""
        return await self._call_replica("reset_prefix_cache")

    async def _call_replica(self, method: str) -> Any:
        try:
            return await getattr(self._handle, method).remote()
        except Exception as exc:
            raise engine_error(exc) from None

    @property
    def errored(self) -> bool:
        return self._state["errored"]

    def get_stats(self) -> dict[str, Any]:
        return self._state["stats"] or {}

    @property
    def metrics(self) -> bytes:
        """The LLMServer replica's Prometheus text, as last polled."""
        return self._state["metrics"]

    async def poll_state(self, interval: float) -> None:
        """Refresh what `errored`, `get_stats` and `metrics` report, every `interval` seconds, for ever."""
        while True:
            try:
                self._state = await self._handle.get_state.remote()
            except Exception as exc:
                # A replica being replaced: the next poll reaches its successor.
                logger.debug("polling the LLMServer failed: %r", exc)
                self._state = EngineState(errored=True, stats=None, metrics=self._state["metrics"])
            await asyncio.sleep(interval)


class ReplicaMetrics:
    """Stands in for the app's `PrometheusStatLogger`: /metrics shows the metrics an LLMServer
    replica's engine records (request counts, latency histograms, gauges), as last polled. With
    several replicas each poll reaches one of them; with several models, one replica of each, their
    series told apart by the model_name label. The ingress's own counters join them: failovers, and
    the requests run with each LoRA adapter (over every replica)."""

    def __init__(self, clients: list[DeploymentEngineClient], ingress_registry: CollectorRegistry) -> None:
        self._clients = clients
        self._ingress_registry = ingress_registry
        # Counted here, over every replica: the ingress sends each request.
        self._lora_requests = lora_request_counter(ingress_registry)

    async def refresh(self, engine: EngineClient) -> None:
        """Nothing to do: each replica refreshes its metrics when polled."""

    def count_lora_requests(self, model_name: str, lora_name: str, count: int) -> None:
        self._lora_requests.labels(model_name, lora_name).inc(count)

    def render(self) -> bytes:
        # Merged, not joined: the ingress's counts (failover, requests per adapter) and the replicas'
        # texts may share a family (the replicas declare raypage:lora_adapter_requests too).
        ingress = generate_latest(self._ingress_registry)
        return merge_prometheus_texts([*(client.metrics for client in self._clients), ingress])


class _Families:
    """A collector of already-made metric families, for `generate_latest`."""

    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> list[Metric]:
        return self._families


def merge_prometheus_texts(texts: list[bytes]) -> bytes:
    """One exposition of several: each family once (its HELP and TYPE), with every text's samples."""
    families: dict[str, Metric] = {}
    for text in texts:
        for family in text_string_to_metric_families(text.decode()):
            if family.name in families:
                families[family.name].samples.extend(family.samples)
            else:
                families[family.name] = family
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(list(families.values())))
    return generate_latest(registry)


def engine_error(exc: Exception) -> Exception:
    """The error a replica call failed with, as the app's error handlers know it."""
    if isinstance(exc, RayTaskError) and isinstance(exc.cause, Exception):
        return exc.cause  # the engine's own ValueError or EngineDeadError, without Ray's traceback
    if isinstance(exc, _REPLICA_GONE):
        return EngineDeadError(f"the LLMServer replica is gone ({type(exc).__name__})")
    return exc


@serve.deployment(name="OpenAIIngress")
@serve.ingress()
class OpenAIIngress:
    """The HTTP front door: OpenAI's routes, /health, /metrics, /tokenize, over the LLMServer
    deployment of each model: `models` holds (its handle, its flat engine settings, its served names),
    the first being the model a request that names none gets, and `adapters` where each model's LoRA
    adapters come from (none: no model has any). `failover` says whether (and how long for) a request
    whose replica fails is resumed on another."""

    def __init__(
        self,
        models: list[tuple[DeploymentHandle, dict[str, Any], list[str]]],
        settings: ServerSettings,
        failover: FailoverSettings,
        adapters: Sequence[LoRASources] = (),
    ) -> None:
        self._registry = CollectorRegistry()
        counters = FailoverMetrics(self._registry, [names[0] for _, _, names in models])
        self._clients = [
            DeploymentEngineClient(
                handle, engine_settings, failover, (counters.resumed[names[0]], counters.failed[names[0]])
            )
            for handle, engine_settings, names in models
        ]
        self._models = [
            ServedModel(client, names, lora)
            for client, (_, _, names), lora in zip(
                self._clients, models, adapters or [LoRASources()] * len(models), strict=True
            )
        ]
        self._settings = settings
        self._poll_tasks: list[asyncio.Task] = []

    async def __serve_build_asgi_app__(self) -> FastAPI:
        # Serve calls this on the replica's event loop once the constructor has run.
        self._poll_tasks = [asyncio.create_task(c.poll_state(STATE_POLL_INTERVAL_S)) for c in self._clients]
        first, *others = self._models
        return build_app(
            first.engine,
            self._settings,
            prometheus=ReplicaMetrics(self._clients, self._registry),
            other_models=others,
        )

    def __del__(self) -> None:
        # A replica whose constructor failed has no poll tasks.
        for task in getattr(self, "_poll_tasks", []):
            task.cancel()
