"""`raypage api-server`: the OpenAI-compatible app over an `AsyncLLMEngine`, served by uvicorn.

raypage api-server --host 127.0.0.1 --port 8000 [--api-key K] [--served-model-name NAME] [engine flags]
raypage api-server --model BASE --enable-lora --lora-modules sql=/adapters/sql [--allow-runtime-lora-updating]
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
from typing import Any

import psutil
import uvicorn
from uvicorn.main import STARTUP_FAILURE

from cluster.engine_args import engine_settings_from_args
from cluster.metrics import LoggingStatLogger, PrometheusStatLogger
from cluster.openai.app import ServerSettings, build_app, served_model_names
from cluster.openai.drain import DrainState
from cluster.openai.engine_watching_server import EngineWatchingServer
from cluster.openai.reasoning_parsers import REASONING_PARSERS
from cluster.openai.serving_models import (
    RUNTIME_LORA_UPDATING_ENV,
    LoRASources,
    parse_lora_module,
    runtime_lora_updating_allowed,
)
from cluster.openai.tool_calling import AUTO_TOOL_PARSERS
from engine.config import EngineConfig
from engine.config_resolve import resolve_engine_config
from engine.frontend.async_llm_engine import AsyncLLMEngine
from engine.process.process_utils import kill_descendants

logger = logging.getLogger(__name__)

API_KEY_ENV = "RAYPAGE_API_KEY"
# Seconds uvicorn waits for open connections once the drain is over (their responses are complete
# by then: only idle keep-alive connections are left to close).
GRACEFUL_SHUTDOWN_S = 5
DEFAULT_DRAIN_TIMEOUT_S = 30.0
# Seconds the killed processes of a forced stop get to be reaped before the server exits.
FORCED_STOP_WAIT_S = 3.0


def add_server_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("server", "HTTP server settings.")
    group.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    group.add_argument("--port", type=int, default=8000, help="port to listen on (default: 8000)")
    group.add_argument(
        "--api-key",
        default=os.environ.get(API_KEY_ENV),
        help=f"require 'Authorization: Bearer KEY' on every route but /health and /metrics "
        f"(default: ${API_KEY_ENV}, else no key)",
    )
    group.add_argument(
        "--served-model-name",
        nargs="+",
        metavar="NAME",
        help="names clients use in 'model' (default: the --model value, or the packaged model's name)",
    )
    group.add_argument(
        "--max-request-body-bytes",
        type=int,
        default=1 << 20,
        help="larger request bodies get 413 (default: 1048576)",
    )
    group.add_argument(
        "--log-stats-interval",
        type=float,
        default=10.0,
        help="seconds between throughput log lines; 0 turns them off (default: 10)",
    )
    group.add_argument(
        "--request-timeout",
        type=float,
        help="seconds after which a request that sets no 'timeout' of its own is aborted (504, or an "
        "error event in a stream) (default: none)",
    )
    group.add_argument(
        "--drain-timeout-s",
        type=float,
        default=DEFAULT_DRAIN_TIMEOUT_S,
        help="after SIGTERM or SIGINT, seconds the requests in flight get to finish (new ones get 503) "
        f"before the rest are aborted (default: {DEFAULT_DRAIN_TIMEOUT_S:g})",
    )
    group.add_argument("--disable-access-log", action="store_true", help="do not log every request")
    group.add_argument(
        "--enable-prompt-tokens-details",
        action="store_true",
        help="report the prompt tokens the prefix cache held in usage.prompt_tokens_details.cached_tokens",
    )
    group.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='allow tool_choice "auto": the model decides whether to call tools, and --tool-call-parser '
        "finds the calls in its output (needs --tool-call-parser)",
    )
    group.add_argument(
        "--tool-call-parser",
        choices=AUTO_TOOL_PARSERS,
        help='the format of the model\'s own tool calls, for tool_choice "auto"',
    )
    group.add_argument(
        "--reasoning-parser",
        choices=sorted(REASONING_PARSERS),
        help="the reasoning format of the model's output, for chat: its think block becomes the reply's "
        "reasoning (and reasoning_content), the rest its content",
    )
    group.add_argument(
        "--lora-modules",
        nargs="+",
        default=[],
        metavar="MODULE",
        help="LoRA adapters to serve (needs --enable-lora), each name=path or vLLM's JSON object "
        '{"name": ..., "path": ..., "base_model_name": ...}; a request names one in its model',
    )
    group.add_argument(
        "--allow-runtime-lora-updating",
        action="store_true",
        help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (also on when "
        f"${RUNTIME_LORA_UPDATING_ENV}, vLLM's switch, is true)",
    )


def server_settings(args: argparse.Namespace) -> ServerSettings:
    """The app settings from the parsed flags; ValueError on a bad one."""
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}")
    if args.drain_timeout_s < 0:
        raise ValueError(f"--drain-timeout-s must be at least 0, got {args.drain_timeout_s}")
    model = getattr(args, "model", None)
    return ServerSettings(
        served_model_names=served_model_names(args.served_model_name, model),
        api_key=args.api_key or None,
        max_request_body_bytes=args.max_request_body_bytes,
        log_stats_interval=args.log_stats_interval,
        request_timeout_s=args.request_timeout,
        enable_prompt_tokens_details=args.enable_prompt_tokens_details,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
        lora=LoRASources(tuple(parse_lora_module(module) for module in args.lora_modules)),
        allow_runtime_lora_updating=runtime_lora_updating_allowed(args.allow_runtime_lora_updating),
    )


def check_args(args: argparse.Namespace) -> None:
    """The server flags, and the engine flags they need; ValueError on a bad one, before any weights load."""
    settings = server_settings(args)
    if (
        settings.lora.configured
        and not EngineConfig.from_flat(**engine_settings_from_args(args)).lora.enable_lora
    ):
        raise ValueError("--lora-modules needs --enable-lora")


def run_api_server(args: argparse.Namespace, engine_settings: dict[str, Any]) -> None:
    """Start the engine core, then serve until SIGINT or SIGTERM, which drain the server (see
    `cluster.openai.drain`); the engine is shut down after, and the process exits with status 0 —
    or with status 1 when the engine dies (see EngineWatchingServer), and with uvicorn's status 3
    when the app fails to start (a bad --lora-modules adapter).

    Outside uvicorn's serving loop (while the engine starts, and while it stops) both signals raise
    KeyboardInterrupt, so that a stop during start-up stops the engine core too, and one during the
    engine's shutdown kills the core at once; either way the core has ended before this process.
    """
    settings = server_settings(args)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        server = _serve(args, settings, engine_settings)
    except KeyboardInterrupt:
        logger.info("interrupted; the engine core is stopped")
        return
    if server.engine_death is not None:
        raise SystemExit(1)
    if not server.started:  # the app's startup failed, and uvicorn logged why
        raise SystemExit(STARTUP_FAILURE)


def _serve(
    args: argparse.Namespace, settings: ServerSettings, engine_settings: dict[str, Any]
) -> EngineWatchingServer:
    # Resolved here, once (the engine takes it as it is): the token-count histograms are bucketed
    # up to max_model_len.
    config = resolve_engine_config(EngineConfig.from_flat(**engine_settings))
    prometheus = PrometheusStatLogger(settings.served_model_names[0], config.model.max_model_len)
    log_stats = LoggingStatLogger()
    engine = AsyncLLMEngine.from_config(config, stat_loggers=[prometheus, log_stats])
    server: EngineWatchingServer | None = None
    try:
        drain = DrainState()
        app = build_app(engine, settings, prometheus, log_stats, drain)
        server = EngineWatchingServer(
            uvicorn.Config(
                app,
                host=args.host,
                port=args.port,
                access_log=not args.disable_access_log,
                timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
            ),
            drain,
            engine,
            args.drain_timeout_s,
        )
        server.run()
    finally:
        if server is not None and server.force_exit:
            # A second signal: the engine core and its workers are killed rather than asked to stop
            # (their own clean-up can take seconds on a busy machine), and reaped all the same.
            psutil.wait_procs(kill_descendants(psutil.Process()), timeout=FORCED_STOP_WAIT_S)
        engine.shutdown()
    return server
