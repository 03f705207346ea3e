"""The args of `cluster.serve_app:build_app` (a Serve config's `args:`, or `raypage serve`'s flags),
parsed and validated without starting anything.

Three kinds of keys share one flat mapping: `config` (a flat engine YAML file), flat engine keys
(which override the file's), and the Serve keys of `ServeOptions` (HTTP settings and deployment
options). A key of none of these kinds is an error that names it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from cluster.openai.app import ServerSettings, served_model_names
from engine.config import EngineConfig, checked_flat_settings, describe_validation_error

ENGINE_FILE_KEY = "config"


class ServeOptions(BaseModel):
    """The Serve keys of the app's args: the HTTP app's settings and the deployments' options."""

    model_config = ConfigDict(extra="forbid")

    served_model_name: str | list[str] | None = Field(
        None, description="Names clients use in 'model'; None: the model path, or the packaged model's name"
    )
    api_key: str | None = Field(
        None,
        repr=False,  # never in a log line (Serve logs its deployments' arguments)
        description="Require 'Authorization: Bearer KEY' on every route but /health and /metrics",
    )
    max_request_body_bytes: int = Field(1 << 20, gt=0, description="Larger request bodies get 413")
    log_stats_interval: float = Field(
        10.0, ge=0, description="Seconds between the engine's throughput log lines; 0 turns them off"
    )
    enable_access_log: bool = Field(True, description="Log every HTTP request in the ingress replica's log")
    ingress: Literal["engine", "separate"] = Field(
        "engine",
        description="'engine': each LLMServer replica serves the OpenAI app over its own engine (one "
        "process hop fewer); 'separate': an OpenAIIngress deployment in front, calling the LLMServer "
        "replicas through a DeploymentHandle",
    )
    num_replicas: int = Field(1, ge=1, description="LLMServer replicas, each with its own engine")
    max_ongoing_requests: int | None = Field(
        None,
        ge=1,
        description="Requests one LLMServer replica takes at once; None: what its engine admits, "
        "max_num_seqs + max_waiting_requests, so that Serve hands a replica no more than its engine "
        "takes (Serve's default of 5 would starve the engine's continuous batching)",
    )
    request_timeout_s: float | None = Field(
        None, gt=0, description="Deadline of a request that sets no 'timeout' of its own; None: none"
    )
    drain_timeout_s: float = Field(
        30.0,
        ge=0,
        description="Seconds a stopping LLMServer replica (raypage serve's SIGTERM, a replacement, a "
        "scale-down) gives its requests in flight before Serve stops it (graceful_shutdown_timeout_s)",
    )
    llm_server_cpus: float = Field(
        1.0,
        ge=0,
        description="CPUs of each LLMServer replica itself (with the ray executor: added to the first "
        "bundle of its placement group, beside worker rank 0's)",
    )
    ingress_cpus: float = Field(
        1.0, ge=0, description="CPUs of each OpenAIIngress replica (with ingress: separate)"
    )
    replica_niceness: int | None = Field(
        None,
        ge=-20,
        le=19,
        description="Process niceness of each LLMServer replica and its engine core (Ray starts its "
        "workers at 15); None keeps Ray's",
    )
    stream_batch_interval_ms: float = Field(
        50.0,
        ge=0,
        description="With ingress: separate, a request's outputs produced within this window cross "
        "from the LLMServer to the ingress as one message (the first output at once); 0 sends each on its own",
    )
    health_check_period_s: float = Field(
        10.0, gt=0, description="Seconds between Serve's health checks of an LLMServer replica"
    )
    health_check_timeout_s: float = Field(
        30.0, gt=0, description="Seconds a health check may take before it counts as failed"
    )


@dataclasses.dataclass(frozen=True)
class ServeAppSettings:
    """Everything `build_app` needs, checked: the engine's flat settings, the config they make (not
    resolved: the model files are read on the replicas), the HTTP settings and the Serve options."""

    engine_settings: dict[str, Any]
    engine_config: EngineConfig
    server: ServerSettings
    options: ServeOptions


def parse_app_args(args: Mapping[str, Any]) -> ServeAppSettings:
    """Split and validate `args`; ValueError naming the bad key (and the engine file, if from it)."""
    args = dict(args)
    path = args.pop(ENGINE_FILE_KEY, None)
    option_args = {key: args.pop(key) for key in list(args) if key in ServeOptions.model_fields}
    unknown = sorted(set(args) - set(EngineConfig.flat_fields()))
    if unknown:
        raise ValueError(
            f"unknown key(s) in the Serve app's args: {', '.join(map(repr, unknown))}; known keys are "
            f"{ENGINE_FILE_KEY!r}, the Serve keys {', '.join(ServeOptions.model_fields)} and the flat "
            f"engine keys {', '.join(EngineConfig.flat_fields())}"
        )
    engine_settings = checked_flat_settings(path, args, ENGINE_FILE_KEY)
    engine_config = EngineConfig.from_flat(**engine_settings)
    try:
        options = ServeOptions(**option_args)
    except ValidationError as exc:
        raise ValueError(f"invalid Serve settings: {describe_validation_error(exc)}") from None
    server = ServerSettings(
        served_model_names=served_model_names(options.served_model_name, engine_config.model.model),
        api_key=options.api_key or None,
        max_request_body_bytes=options.max_request_body_bytes,
        log_stats_interval=options.log_stats_interval,
        request_timeout_s=options.request_timeout_s,
    )
    return ServeAppSettings(engine_settings, engine_config, server, options)
