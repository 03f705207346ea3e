"""The Ray Serve application: `LLMServer` replicas that each serve the OpenAI app over their own
engine (args `ingress: engine`, the default), or an OpenAI ingress deployment in front of engine-only
`LLMServer` replicas (`ingress: separate`).

`serve run configs/serve/smollm2.yaml` (import_path `cluster.serve_app:build_app`) and
`raypage serve` both build it with `build_app(args)`; see `cluster.serve.args` for the args. With
several models (`models:`) each has an LLMServer deployment of its own (its replicas, its
autoscaling) behind one OpenAIIngress, which routes by the request's `model`.
With `distributed_executor_backend: ray`, each LLMServer replica gets a placement group of one
bundle per worker (the replica's own CPUs merged into bundle 0) and its engine's workers run there.
LoRA adapters (`lora_modules`, `dynamic_lora_loading_path`) are loaded by the replicas on demand,
at most `max_num_adapters_per_replica` each; see `cluster.serve.adapters` and docs/lora.md.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from ray import serve

from cluster.serve.args import ServeAppSettings, parse_app_models
from cluster.serve.failover import FailoverSettings
from cluster.serve.ingress import OpenAIIngress
from cluster.serve.llm_server import HandleLLMServer, LLMServer
from cluster.serve.routing import ROUTER_CLASSES

# Serve needs a bound even when the engine has none (max_waiting_requests: -1).
UNBOUNDED_MAX_ONGOING_REQUESTS = 100_000
# Seconds between a stopping replica's checks for requests still in flight.
DRAIN_POLL_S = 0.5


def build_app(args: dict[str, Any]) -> serve.Application:
    """The application from the Serve config's (or the command line's) args; ValueError on a bad one."""
    models = parse_app_models(args)
    first = models[0]
    if first.options.ingress == "engine":  # one model: parse_app_models gives several a separate ingress
        return LLMServer.options(**llm_server_options(first)).bind(
            first.engine_settings, first.server, niceness=first.options.replica_niceness
        )
    llm_servers = [
        HandleLLMServer.options(name=llm_server_name(model, len(models)), **llm_server_options(model)).bind(
            model.engine_settings,
            model.server,
            first.options.stream_batch_interval_ms / 1000,
            niceness=model.options.replica_niceness,
            max_adapters=model.max_adapters_per_replica,
        )
        for model in models
    ]
    served_models = [
        (llm_server, model.engine_settings, model.server.served_model_names)
        for llm_server, model in zip(llm_servers, models, strict=True)
    ]
    failover = FailoverSettings(first.options.failover, first.options.failover_timeout_s)
    adapters = [model.server.lora for model in models]
    return OpenAIIngress.options(**ingress_options(models)).bind(
        served_models, first.server, failover, adapters
    )


def llm_server_name(settings: ServeAppSettings, num_models: int) -> str:
    """The model's LLMServer deployment name: "LLMServer", or with several models
    "LLMServer:<its first served name>" ('#' is Serve's replica-id delimiter)."""
    if num_models == 1:
        return "LLMServer"
    return "LLMServer:" + re.sub("#", "_", settings.server.served_model_names[0])


def replica_max_ongoing_requests(settings: ServeAppSettings) -> int:
    """Requests one LLMServer replica takes at once: as set, else what its engine admits (beyond
    which the engine would answer 503 anyway); Serve queues the rest in front of the replicas."""
    if settings.options.max_ongoing_requests is not None:
        return settings.options.max_ongoing_requests
    admitted = settings.engine_config.scheduler.max_admitted_requests
    return admitted if admitted is not None else UNBOUNDED_MAX_ONGOING_REQUESTS


def graceful_shutdown_options(settings: ServeAppSettings) -> dict[str, float]:
    """Serve's graceful shutdown of a replica, from drain_timeout_s: a stopping replica takes no new
    requests and gets that long for those in flight (polled every DRAIN_POLL_S) before Serve calls
    its destructor, which aborts what is left and stops the engine, or kills it when time is up."""
    return {
        "graceful_shutdown_timeout_s": settings.options.drain_timeout_s,
        "graceful_shutdown_wait_loop_s": DRAIN_POLL_S,
    }


def llm_server_options(settings: ServeAppSettings) -> dict[str, Any]:
    """Deployment options of LLMServer: replicas, admission, health checks, graceful shutdown, and
    with the ray executor the placement group its workers go into."""
    options = settings.options
    # Serve takes a fixed count or an autoscaling config; each replica reserves its own CPUs (or
    # placement group), autoscaled ones too.
    replicas: dict[str, Any] = (
        {"num_replicas": options.num_replicas}
        if options.autoscaling_config is None
        else {"autoscaling_config": options.autoscaling_config}
    )
    deployment: dict[str, Any] = {
        **replicas,
        "max_ongoing_requests": replica_max_ongoing_requests(settings),
        "health_check_period_s": options.health_check_period_s,
        "health_check_timeout_s": options.health_check_timeout_s,
        **graceful_shutdown_options(settings),
        "ray_actor_options": {"num_cpus": options.llm_server_cpus},
        # Behind a separate ingress its calls come from there (which logs every HTTP request) and
        # from its state poll.
        "logging_config": {"enable_access_log": options.ingress == "engine" and options.enable_access_log},
    }
    router = ROUTER_CLASSES.get(options.routing_policy)
    if router is not None:
        deployment["request_router_config"] = {
            "request_router_class": router,
            "request_router_kwargs": {
                "load_margin": options.routing_load_margin,
                "block_size": settings.engine_config.cache.block_size,
            },
            "request_routing_stats_period_s": options.routing_stats_period_s,
        }
    config = settings.engine_config
    if config.parallel.executor_backend == "ray":
        from cluster.serve.replica_bundles import replica_bundles  # imports Ray: only when used

        deployment["placement_group_bundles"] = replica_bundles(config, {"CPU": options.llm_server_cpus})
        deployment["placement_group_strategy"] = config.parallel.placement_strategy
    return deployment


def ingress_options(models: Sequence[ServeAppSettings]) -> dict[str, Any]:
    """Deployment options of the OpenAIIngress: the app's keys are the first model's (all share them)."""
    options = models[0].options
    return {
        # Every LLMServer replica's share passes through the ingress.
        "max_ongoing_requests": sum(
            model.options.max_replicas * replica_max_ongoing_requests(model) for model in models
        ),
        **graceful_shutdown_options(models[0]),
        "ray_actor_options": {"num_cpus": options.ingress_cpus},
        "logging_config": {"enable_access_log": options.enable_access_log},
    }


def required_cpus(settings: ServeAppSettings) -> float:
    """CPUs the (one-model) app reserves in the cluster at most: every replica of its deployments
    (all max_replicas when autoscaled), workers included."""
    deployment = llm_server_options(settings)
    bundles = deployment.get("placement_group_bundles")
    per_server = (
        sum(bundle.get("CPU", 0.0) for bundle in bundles) if bundles else settings.options.llm_server_cpus
    )
    ingress = settings.options.ingress_cpus if settings.options.ingress == "separate" else 0.0
    return settings.options.max_replicas * per_server + ingress
