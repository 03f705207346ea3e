"""The Ray Serve application: an OpenAI ingress deployment in front of an `LLMServer` deployment.

`serve run configs/serve/smollm2.yaml` (import_path `cluster.serve_app:build_app`) and
`raypage serve` both build it with `build_app(args)`; see `cluster.serve.args` for the args.
With `distributed_executor_backend: ray`, each LLMServer replica gets a placement group of one
bundle per worker (the replica's own CPUs merged into bundle 0) and its engine's workers run there.
"""

from __future__ import annotations

from typing import Any

from ray import serve

from cluster.serve.args import ServeAppSettings, parse_app_args
from cluster.serve.ingress import OpenAIIngress
from cluster.serve.llm_server import LLMServer


def build_app(args: dict[str, Any]) -> serve.Application:
    """The application from the Serve config's (or the command line's) args; ValueError on a bad one."""
    settings = parse_app_args(args)
    llm_server = LLMServer.options(**llm_server_options(settings)).bind(
        settings.engine_settings,
        settings.server.served_model_names[0],
        settings.server.log_stats_interval,
        settings.options.stream_batch_interval_ms / 1000,
    )
    return OpenAIIngress.options(**ingress_options(settings)).bind(
        llm_server, settings.engine_settings, settings.server
    )


def llm_server_options(settings: ServeAppSettings) -> dict[str, Any]:
    """Deployment options of LLMServer: replicas, health checks, and with the ray executor the
    placement group its workers go into."""
    options = settings.options
    deployment: dict[str, Any] = {
        "num_replicas": options.num_replicas,
        "max_ongoing_requests": options.max_ongoing_requests,
        "health_check_period_s": options.health_check_period_s,
        "health_check_timeout_s": options.health_check_timeout_s,
        "ray_actor_options": {"num_cpus": options.llm_server_cpus},
        # Its calls come from the ingress (which logs every HTTP request) and its state poll.
        "logging_config": {"enable_access_log": False},
    }
    config = settings.engine_config
    if config.parallel.executor_backend == "ray":
        from cluster.serve.replica_bundles import replica_bundles  # imports Ray: only when used

        deployment["placement_group_bundles"] = replica_bundles(config, {"CPU": options.llm_server_cpus})
        deployment["placement_group_strategy"] = config.parallel.placement_strategy
    return deployment


def ingress_options(settings: ServeAppSettings) -> dict[str, Any]:
    options = settings.options
    return {
        "max_ongoing_requests": options.max_ongoing_requests,
        "ray_actor_options": {"num_cpus": options.ingress_cpus},
        "logging_config": {"enable_access_log": options.enable_access_log},
    }


def required_cpus(settings: ServeAppSettings) -> float:
    """CPUs the app reserves in the cluster: every replica of both deployments, workers included."""
    deployment = llm_server_options(settings)
    bundles = deployment.get("placement_group_bundles")
    per_server = (
        sum(bundle.get("CPU", 0.0) for bundle in bundles) if bundles else settings.options.llm_server_cpus
    )
    return settings.options.num_replicas * per_server + settings.options.ingress_cpus
