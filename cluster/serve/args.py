"""The args of `cluster.serve_app:build_app` (a Serve config's `args:`, or `raypage serve`'s flags),
parsed and validated without starting anything.

Three kinds of keys share one flat mapping: `config` (a flat engine YAML file), flat engine keys
(which override the file's), and the Serve keys of `ServeOptions` (HTTP settings and deployment
options). A key of none of these kinds is an error that names it.

Several models in one app: `models:` lists one mapping per model (its `config`, engine keys, served
names and deployment keys, `MODEL_KEYS`); the keys beside `models` are the app's (its one ingress's)
and the defaults of every model's engine. Each model gets its own LLMServer deployment behind one
OpenAIIngress that routes by the request's `model`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from ray.serve.config import AutoscalingConfig

from cluster.openai.app import ServerSettings, served_model_names
from cluster.openai.reasoning_parsers import REASONING_PARSERS
from cluster.openai.serving_models import LoRASources, parse_lora_module, runtime_lora_updating_allowed
from cluster.openai.tool_calling import AUTO_TOOL_PARSERS
from engine.config import EngineConfig, checked_flat_settings, describe_validation_error

ENGINE_FILE_KEY = "config"
MODELS_KEY = "models"
# The Serve keys a model of a multi-model app sets for itself (its LLMServer deployment's); the
# others are the app's, set beside `models`.
MODEL_KEYS = (
    "served_model_name",
    "num_replicas",
    "autoscaling_config",
    "max_ongoing_requests",
    "llm_server_cpus",
    "replica_niceness",
    "health_check_period_s",
    "health_check_timeout_s",
    "lora_modules",
    "dynamic_lora_loading_path",
    "max_num_adapters_per_replica",
)


class ServeOptions(BaseModel):
    """The Serve keys of the app's args: the HTTP app's settings and the deployments' options."""

    model_config = ConfigDict(extra="forbid")

    @field_validator("autoscaling_config")
    @classmethod
    def _serve_accepts(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is None:
            return None
        # Serve's schema ignores unknown keys: a typo would silently keep its default.
        unknown = sorted(set(value) - set(AutoscalingConfig.model_fields))
        if unknown:
            raise ValueError(
                f"unknown key(s) {', '.join(map(repr, unknown))}; Serve's autoscaling_config keys are "
                f"{', '.join(AutoscalingConfig.model_fields)}"
            )
        try:
            AutoscalingConfig(**value)
        except ValidationError as exc:
            raise ValueError(describe_validation_error(exc)) from None
        return value

    @model_validator(mode="after")
    def _resolve_defaults(self) -> ServeOptions:
        if self.autoscaling_config is not None and "num_replicas" in self.model_fields_set:
            raise ValueError("set num_replicas or autoscaling_config, not both (Serve takes one)")
        several = self.max_replicas > 1
        if self.ingress is None:
            self.ingress = "separate" if several else "engine"
        if self.routing_policy is None:
            self.routing_policy = "kv_aware" if several and self.ingress == "separate" else "pow2"
        if self.ingress == "engine" and self.routing_policy != "pow2":
            raise ValueError(
                f"routing_policy {self.routing_policy!r} needs ingress: separate (the ingress tokenizes "
                "and routes; with ingress: engine Serve's proxy routes HTTP requests with pow2)"
            )
        return self

    @property
    def max_replicas(self) -> int:
        """The most LLMServer replicas the deployment may run at once."""
        if self.autoscaling_config is None:
            return self.num_replicas
        return AutoscalingConfig(**self.autoscaling_config).max_replicas

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
    enable_prompt_tokens_details: bool = Field(
        False, description="Report the prompt tokens the prefix cache held in usage.prompt_tokens_details"
    )
    enable_auto_tool_choice: bool = Field(
        False,
        description='Allow tool_choice "auto": the model decides whether to call tools, and '
        "tool_call_parser finds the calls in its output",
    )
    tool_call_parser: str | None = Field(
        None,
        description='The format of the model\'s own tool calls, for tool_choice "auto": '
        + ", ".join(AUTO_TOOL_PARSERS),
    )
    reasoning_parser: str | None = Field(
        None,
        description="The reasoning format of the model's output, for chat: its think block becomes the "
        "reply's reasoning (and reasoning_content), the rest its content: "
        + ", ".join(sorted(REASONING_PARSERS)),
    )
    ingress: Literal["engine", "separate"] | None = Field(
        None,
        description="'engine': each LLMServer replica serves the OpenAI app over its own engine (one "
        "process hop fewer); 'separate': an OpenAIIngress deployment in front, calling the LLMServer "
        "replicas through a DeploymentHandle; None: 'engine' for one replica, 'separate' for more "
        "(or autoscaling), where the ingress routes",
    )
    routing_policy: Literal["kv_aware", "prefix_text", "pow2"] | None = Field(
        None,
        description="How the separate ingress picks an LLMServer replica: 'kv_aware' (the replica whose "
        "reported prefix cache holds the longest prefix of the prompt), 'prefix_text' (the one that has "
        "been sent the longest prefix of its text, Ray Serve LLM's way), 'pow2' (Serve's default); "
        "None: kv_aware with a separate ingress over more than one replica, else pow2",
    )
    routing_stats_period_s: float = Field(
        1.0, gt=0, description="Seconds between an LLMServer replica's reports of its prefix cache (kv_aware)"
    )
    routing_load_margin: float = Field(
        8.0, ge=0, description="Requests by which a prompt's prefix may draw it to a busier replica"
    )
    num_replicas: int = Field(
        1, ge=1, description="LLMServer replicas, each with its own engine (without autoscaling_config)"
    )
    autoscaling_config: dict[str, Any] | None = Field(
        None,
        description="Serve's autoscaling_config of the LLMServer deployment (min_replicas, max_replicas, "
        "initial_replicas, target_ongoing_requests, upscale_delay_s, downscale_delay_s, ...), checked "
        "by Serve's own AutoscalingConfig schema; None: a fixed num_replicas",
    )
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
    failover: bool = Field(
        True,
        description="With ingress: separate, a request whose LLMServer replica fails (its actor killed, its "
        "node removed, its engine dead) continues on another replica from the tokens already sent; "
        "False: it ends with an error",
    )
    failover_timeout_s: float = Field(
        30.0,
        gt=0,
        description="Seconds a failed replica's request waits for another replica to take it over "
        "(send its first output) before it ends with an error",
    )
    health_check_period_s: float = Field(
        10.0, gt=0, description="Seconds between Serve's health checks of an LLMServer replica"
    )
    health_check_timeout_s: float = Field(
        30.0, gt=0, description="Seconds a health check may take before it counts as failed"
    )
    lora_modules: list[str | dict[str, Any]] | None = Field(
        None,
        description="LoRA adapters to serve (needs enable_lora), each 'name=path' or a mapping with name, "
        "path and optionally base_model_name (vLLM's --lora-modules); a request's model picks one by name",
    )
    dynamic_lora_loading_path: str | None = Field(
        None,
        description="A folder of PEFT adapter folders (needs enable_lora): a request for "
        "'<served model name>:<adapter>' runs the adapter in <folder>/<adapter>, which an LLMServer "
        "replica loads on first use (Ray Serve LLM's dynamic_lora_loading_path)",
    )
    max_num_adapters_per_replica: int | None = Field(
        None,
        ge=1,
        description="Adapters one LLMServer replica holds at most; loading another evicts its least recently "
        "used one. Raises the engine's max_cpu_loras to it when that is not set; None: the engine's "
        "max_cpu_loras (else max_loras)",
    )
    allow_runtime_lora_updating: bool = Field(
        False,
        description="Serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (also on when "
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING is true where the app is built)",
    )


@dataclasses.dataclass(frozen=True)
class ServeAppSettings:
    """Everything `build_app` needs, checked: the engine's flat settings, the config they make (not
    resolved: the model files are read on the replicas), the HTTP settings and the Serve options."""

    engine_settings: dict[str, Any]
    engine_config: EngineConfig
    server: ServerSettings
    options: ServeOptions

    @property
    def max_adapters_per_replica(self) -> int:
        """The LoRA adapters one LLMServer replica holds at most (its engine's host cache holds them all)."""
        return self.options.max_num_adapters_per_replica or self.engine_config.lora.host_cache_size


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
    try:
        options = ServeOptions(**option_args)
        lora = LoRASources(
            tuple(parse_lora_module(module) for module in options.lora_modules or ()),
            options.dynamic_lora_loading_path,
        )
    except ValidationError as exc:
        raise ValueError(f"invalid Serve settings: {describe_validation_error(exc)}") from None
    except ValueError as exc:
        raise ValueError(f"invalid Serve settings: lora_modules: {exc}") from None
    engine_settings = _with_adapter_room(
        checked_flat_settings(path, args, ENGINE_FILE_KEY), options.max_num_adapters_per_replica
    )
    engine_config = EngineConfig.from_flat(**engine_settings)
    if lora.configured and not engine_config.lora.enable_lora:
        raise ValueError("lora_modules and dynamic_lora_loading_path need the engine key enable_lora: true")
    server = ServerSettings(
        served_model_names=served_model_names(options.served_model_name, engine_config.model.model),
        api_key=options.api_key or None,
        max_request_body_bytes=options.max_request_body_bytes,
        log_stats_interval=options.log_stats_interval,
        request_timeout_s=options.request_timeout_s,
        enable_prompt_tokens_details=options.enable_prompt_tokens_details,
        enable_auto_tool_choice=options.enable_auto_tool_choice,
        tool_call_parser=options.tool_call_parser,
        reasoning_parser=options.reasoning_parser,
        lora=lora,
        allow_runtime_lora_updating=runtime_lora_updating_allowed(options.allow_runtime_lora_updating),
    )
    return ServeAppSettings(engine_settings, engine_config, server, options)


def _with_adapter_room(engine_settings: dict[str, Any], max_adapters: int | None) -> dict[str, Any]:
    """The engine settings with a host cache of at least `max_adapters` adapters, so that the engine
    never evicts one that Serve's multiplexing counts as loaded: max_cpu_loras is raised to it when
    not set; ValueError when set lower."""
    if max_adapters is None:
        return engine_settings
    lora = EngineConfig.from_flat(**engine_settings).lora
    if lora.max_cpu_loras is None:
        return {**engine_settings, "max_cpu_loras": max(max_adapters, lora.max_loras)}
    if lora.max_cpu_loras < max_adapters:
        raise ValueError(
            f"max_num_adapters_per_replica ({max_adapters}) must be at most the engine's max_cpu_loras "
            f"({lora.max_cpu_loras}), which holds every adapter a replica keeps"
        )
    return engine_settings


def parse_app_models(args: Mapping[str, Any]) -> list[ServeAppSettings]:
    """The app's models, each parsed as `parse_app_args` does: one, or one per entry of `models`
    (beside which the app's keys and every model's default engine keys stand); ValueError naming the
    bad key and the model it belongs to."""
    if MODELS_KEY not in args:
        return [parse_app_args(args)]
    shared = dict(args)
    entries = shared.pop(MODELS_KEY)
    if not isinstance(entries, list) or not entries or not all(isinstance(e, Mapping) for e in entries):
        raise ValueError(f"{MODELS_KEY!r} must be a non-empty list of mappings, one per model")
    if shared.get("ingress", "separate") != "separate":
        raise ValueError(f"{MODELS_KEY!r} needs ingress: separate (one ingress routes to every model)")
    shared_model_keys = sorted(set(shared) & set(MODEL_KEYS))
    if shared_model_keys:
        raise ValueError(
            f"{', '.join(map(repr, shared_model_keys))} belong to each entry of {MODELS_KEY!r}, not beside it"
        )
    models = []
    for index, entry in enumerate(entries):
        app_keys = sorted(set(entry) & (set(ServeOptions.model_fields) - set(MODEL_KEYS)))
        if app_keys:
            raise ValueError(
                f"{MODELS_KEY}[{index}]: {', '.join(map(repr, app_keys))} are the app's keys: set them "
                f"beside {MODELS_KEY!r}"
            )
        try:
            models.append(parse_app_args({**shared, **entry, "ingress": "separate"}))
        except ValueError as exc:
            raise ValueError(f"{MODELS_KEY}[{index}]: {exc}") from None
    names = [
        name
        for model in models
        for name in [*model.server.served_model_names, *(module.name for module in model.server.lora.modules)]
    ]
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise ValueError(
            f"served model name(s) {', '.join(map(repr, repeated))} name more than one model or adapter"
        )
    return models
