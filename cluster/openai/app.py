"""The OpenAI-compatible FastAPI app, built by `build_app(engine, settings)` from any engine client.

Routes: POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /health, GET /version,
GET /metrics, POST /tokenize, POST /detokenize, POST /reset_prefix_cache; with runtime LoRA updating
allowed, POST /v1/load_lora_adapter and POST /v1/unload_lora_adapter (vLLM's).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import AsyncIterator, Sequence
from http import HTTPStatus
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Protocol

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import SecretStr

from cluster.metrics import LoggingStatLogger, PrometheusStatLogger
from cluster.openai.catch_all import CatchAllMiddleware
from cluster.openai.drain import DrainMiddleware, DrainState
from cluster.openai.engine_client import EngineClient
from cluster.openai.errors import OpenAIError, install_error_handlers
from cluster.openai.middleware import ApiKeyMiddleware, BodySizeLimitMiddleware
from cluster.openai.model_handlers import ModelRouter, ServedModel
from cluster.openai.protocol import (
    MAX_TIMEOUT_S,
    ChatCompletionRequest,
    CompletionRequest,
    ModelList,
    OpenAIBaseModel,
)
from cluster.openai.protocol_lora import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest
from cluster.openai.protocol_tokenize import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)
from cluster.openai.reasoning_parsers import get_reasoning_parser
from cluster.openai.serving_models import LoRASources
from cluster.openai.tool_calling import check_tool_settings
from engine.models.model_files import PACKAGED_GGUF

logger = logging.getLogger(__name__)

# Open without an API key: load balancers and Prometheus probe these.
OPEN_PATHS = ("/health", "/metrics")


@dataclasses.dataclass
class ServerSettings:
    """HTTP settings of the app (the engine has its own config)."""

    served_model_names: list[str]
    api_key: str | None = dataclasses.field(default=None, repr=False)  # never in a log line
    max_request_body_bytes: int = 1 << 20
    log_stats_interval: float = 10.0  # seconds between throughput log lines; 0 turns them off
    # Deadline of a request that sets no `timeout` of its own; None: none.
    request_timeout_s: float | None = None
    # Usage's prompt_tokens_details.cached_tokens (vLLM's --enable-prompt-tokens-details).
    enable_prompt_tokens_details: bool = False
    # tool_choice "auto": the model's own tool calls, found in its text by this parser (vLLM's
    # --enable-auto-tool-choice --tool-call-parser).
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    # The reasoning format of the model's output (vLLM's --reasoning-parser): the text inside
    # <think>...</think> becomes the chat reply's `reasoning`; None: all of it is content.
    reasoning_parser: str | None = None
    # The served model's LoRA adapters: static modules (vLLM's --lora-modules) and a dynamic folder.
    lora: LoRASources = dataclasses.field(default_factory=LoRASources)
    # POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING).
    allow_runtime_lora_updating: bool = False

    def __post_init__(self) -> None:
        if not self.served_model_names:
            raise ValueError("served_model_names must name at least one model")
        if self.max_request_body_bytes < 1:
            raise ValueError(f"max_request_body_bytes must be positive, got {self.max_request_body_bytes}")
        if self.request_timeout_s is not None and not 0 < self.request_timeout_s <= MAX_TIMEOUT_S:
            raise ValueError(
                f"request_timeout_s must be in (0, {MAX_TIMEOUT_S:g}] seconds, got {self.request_timeout_s}"
            )
        check_tool_settings(self.enable_auto_tool_choice, self.tool_call_parser)
        if self.reasoning_parser is not None:
            get_reasoning_parser(self.reasoning_parser)  # ValueError naming the known ones
        taken = sorted({module.name for module in self.lora.modules} & set(self.served_model_names))
        if taken:
            raise ValueError(f"LoRA module name(s) {', '.join(map(repr, taken))} are served model names")


def served_model_names(requested: str | list[str] | None, model: str | None) -> list[str]:
    """The names a client may use: as asked, else the model path, else the packaged model's name."""
    if isinstance(requested, str):
        return [requested]
    if requested:
        return list(requested)
    return [model if model else Path(PACKAGED_GGUF).name.split(".")[0]]


def _package_version() -> str:
    try:
        return version("raypage")
    except PackageNotFoundError:
        return "unknown"


class MetricsSource(Protocol):
    """What /metrics renders: `PrometheusStatLogger`, or the Serve ingress's view of a replica's."""

    async def refresh(self, engine: EngineClient) -> None: ...

    def count_lora_requests(self, model_name: str, lora_name: str, count: int) -> None: ...

    def render(self) -> bytes: ...


def build_app(
    engine: EngineClient,
    settings: ServerSettings,
    prometheus: MetricsSource | None = None,
    log_stats: LoggingStatLogger | None = None,
    drain: DrainState | None = None,
    other_models: Sequence[ServedModel] = (),
) -> FastAPI:
    """The app serving `engine` under `settings.served_model_names`, and each of `other_models`
    under its own names (a request's `model` picks one; none: `engine`'s).

    `prometheus` and `log_stats` are the stat loggers the engine was started with; without
    `prometheus` the app keeps its own, whose gauges /metrics refreshes from `engine.get_stats()`.
    With `drain` the app counts its requests in flight and refuses new ones once it drains.
    The static LoRA modules are loaded as the app starts (a bad one stops it).
    """
    max_model_len = engine.config.model.max_model_len
    prometheus = prometheus or PrometheusStatLogger(settings.served_model_names[0], max_model_len)
    timeout_s = settings.request_timeout_s
    models = ModelRouter(
        [ServedModel(engine, settings.served_model_names, settings.lora), *other_models],
        timeout_s,
        settings.enable_prompt_tokens_details,
        settings.tool_call_parser if settings.enable_auto_tool_choice else None,
        settings.reasoning_parser,
        prometheus.count_lora_requests,
    )

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await models.init_static_loras()
        task = None
        if log_stats is not None and settings.log_stats_interval > 0:
            task = asyncio.create_task(log_stats_periodically(engine, log_stats, settings.log_stats_interval))
        yield
        if task is not None:
            task.cancel()

    app = FastAPI(title="raypage", version=_package_version(), lifespan=lifespan)
    known_params = frozenset(CompletionRequest.model_fields) | frozenset(ChatCompletionRequest.model_fields)
    install_error_handlers(app, known_params)

    @app.post("/v1/completions")
    async def create_completion(body: CompletionRequest, raw_request: Request):
        _warn_ignored(body)
        return await models.for_model(body.model).completion.create_completion(body, raw_request)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(body: ChatCompletionRequest, raw_request: Request):
        _warn_ignored(body)
        return await models.for_model(body.model).chat.create_chat_completion(body, raw_request)

    @app.get("/v1/models")
    async def list_models() -> ModelList:
        return ModelList(data=models.model_cards())

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> TokenizeResponse:
        return models.for_model(body.model).tokenization.tokenize(body)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        return models.for_model(body.model).tokenization.detokenize(body)

    @app.get("/health")
    async def health() -> Response:
        for model_engine in models.engines:
            await model_engine.check_health()  # EngineDeadError -> 503
        return Response(status_code=200)

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> Response:
        """Forget the cached prefixes (vLLM's route): 200 once done; 409 while requests hold blocks."""
        reset = [await model_engine.reset_prefix_cache() for model_engine in models.engines]
        if not all(reset):
            raise OpenAIError(
                HTTPStatus.CONFLICT, "The prefix cache cannot be reset while requests are running; retry"
            )
        return Response(status_code=200)

    if settings.allow_runtime_lora_updating:

        @app.post("/v1/load_lora_adapter")
        async def load_lora_adapter(body: LoadLoRAAdapterRequest) -> Response:
            await models.load_lora_adapter(body.lora_name, body.lora_path)
            return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

        @app.post("/v1/unload_lora_adapter")
        async def unload_lora_adapter(body: UnloadLoRAAdapterRequest) -> Response:
            await models.unload_lora_adapter(body.lora_name)
            return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    @app.get("/version")
    async def get_version() -> dict[str, str]:
        return {"version": _package_version()}

    @app.get("/metrics")
    async def metrics() -> Response:
        if not engine.errored:
            await prometheus.refresh(engine)
        return Response(prometheus.render(), media_type=CONTENT_TYPE_LATEST)

    # Added last = outermost: the key is checked before any of the body is read.
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=settings.max_request_body_bytes)
    if settings.api_key:
        key = SecretStr(settings.api_key)  # app.user_middleware's repr shows its arguments
        app.add_middleware(ApiKeyMiddleware, api_key=key, open_paths=OPEN_PATHS)
    if drain is not None:
        app.add_middleware(DrainMiddleware, state=drain)
    # Outermost: every response (401 and 413 too) carries the request id, and nothing escapes.
    app.add_middleware(CatchAllMiddleware)
    return app


def _warn_ignored(body: OpenAIBaseModel) -> None:
    ignored = body.ignored_fields()
    if ignored:
        # repr: a client's field name may hold newlines, which would forge log lines.
        logger.warning("ignoring fields this server does not support: %s", ", ".join(map(repr, ignored)))


async def log_stats_periodically(engine: EngineClient, log_stats: LoggingStatLogger, interval: float) -> None:
    """Log the engine's throughput and load every `interval` seconds, until cancelled."""
    while True:
        await asyncio.sleep(interval)
        log_stats.log(None if engine.errored else engine.get_stats())
