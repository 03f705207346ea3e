"""`raypage serve`: the Serve application on a Ray cluster, until SIGINT or SIGTERM.

raypage serve [--config FILE] [--address HOST:PORT] [--host 127.0.0.1] [--port 8000] [--api-key K]
              [--proxy-mode {python,haproxy}] [--cluster-niceness N] [--ingress {engine,separate}]
              [engine flags]

Joins the cluster at --address, or starts a local one (its CPUs: the machine's, or as many as the app
reserves if that is more, since logical CPUs only count reservations), with the --proxy-mode in front
of the replicas (`cluster.serve.proxy_mode`), which listens on host:port; once the app is up, the
local cluster's own processes yield the CPU to the engine (`cluster.serve.local_cluster`). On a
signal Serve is shut down, after the app's replicas have drained their requests in flight (for up
to --drain-timeout-s), and so is the local cluster when this command started it; a second signal
stops at once, killing every process of the local cluster. Either way none of them outlives this one.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import threading
from typing import Any

import psutil
import ray
from ray import serve

from cluster.engine_args import engine_settings_from_args
from cluster.openai.api_server import add_server_args
from cluster.serve.args import parse_app_args
from cluster.serve.local_cluster import DEFAULT_CLUSTER_NICENESS, set_cluster_priorities
from cluster.serve.proxy_mode import PROXY_MODES, default_proxy_mode, proxy_env
from cluster.serve.routing import ROUTING_POLICIES
from cluster.serve_app import build_app, required_cpus
from engine.executor.ray_utils import LOCAL_OBJECT_STORE_BYTES
from engine.process.process_utils import kill_descendants

logger = logging.getLogger(__name__)

APP_NAME = "raypage"
# Seconds killed processes get to be reaped (by their parents, or init) before the command exits.
FORCED_STOP_WAIT_S = 3.0


def add_parser_args(parser: argparse.ArgumentParser) -> None:
    """The flags of `raypage serve` besides the engine's."""
    add_server_args(parser)
    group = parser.add_argument_group("ray serve", "Where the app runs and how Serve manages it.")
    group.add_argument(
        "--address",
        help="Ray cluster to join (host:port of its GCS, or 'auto'); default: start a local one",
    )
    group.add_argument(
        "--num-cpus",
        type=float,
        help="CPUs of the local cluster (default: the machine's, at least what the app reserves)",
    )
    group.add_argument(
        "--object-store-memory",
        type=int,
        default=LOCAL_OBJECT_STORE_BYTES,
        metavar="BYTES",
        help=f"object store of the local cluster (default: {LOCAL_OBJECT_STORE_BYTES}; the engine ships only "
        "scheduler messages and tokens through it)",
    )
    group.add_argument(
        "--proxy-mode",
        choices=PROXY_MODES,
        help="what carries HTTP to the replicas of a local cluster: Serve's Python proxy actor, or "
        "HAProxy (default: haproxy if Serve finds its binary, else python; a joined cluster keeps the "
        "mode it was started with)",
    )
    group.add_argument(
        "--ingress",
        choices=("engine", "separate"),
        help="engine: each LLMServer replica serves the OpenAI app over its own engine; separate: an "
        "OpenAIIngress deployment in front of engine-only replicas, which routes between them (default: "
        "engine for one replica, separate for more)",
    )
    group.add_argument(
        "--replica-niceness",
        type=int,
        default=0,
        help="niceness of each LLMServer replica and its engine core, and on a local cluster of the HTTP "
        "proxy, so that Serve's own processes (started at 15 by Ray) yield the CPU to them; needs "
        "CAP_SYS_NICE below 15 (default: 0)",
    )
    group.add_argument(
        "--cluster-niceness",
        type=int,
        choices=range(20),
        metavar="{0..19}",
        help="niceness at least this for the processes of a local cluster but the replicas, their "
        "engines and the HTTP proxy (Ray's GCS, raylet, agents, monitors; Serve's controller), so "
        "that they take the cores the engine leaves idle; 0 keeps Ray's (default: "
        f"{DEFAULT_CLUSTER_NICENESS}; a joined cluster keeps its own)",
    )
    group.add_argument("--num-replicas", type=int, help="LLMServer replicas (default: 1)")
    group.add_argument(
        "--autoscaling-config",
        type=json.loads,
        help="Serve's autoscaling_config of the LLMServer deployment as JSON, e.g. "
        '\'{"min_replicas": 1, "max_replicas": 4, "target_ongoing_requests": 32}\' (instead of --num-replicas)',
    )
    group.add_argument(
        "--routing-policy",
        choices=ROUTING_POLICIES,
        help="how a separate ingress picks a replica: by the prompt's prefix in the replicas' reported KV "
        "caches, by the text it sent each, or Serve's pow2 (default: kv_aware with several replicas)",
    )
    group.add_argument(
        "--routing-load-margin",
        type=float,
        default=8.0,
        help="requests by which the replica holding a prompt's prefix may be busier than the least-loaded "
        "one and still get it (default: 8)",
    )
    group.add_argument(
        "--llm-server-cpus",
        type=float,
        help="CPUs each LLMServer replica reserves, which Ray gives its engine as threads (default: the "
        "machine's cores on a local cluster, as `raypage api-server` uses them; 1 on a joined one)",
    )
    group.add_argument(
        "--stream-batch-interval-ms",
        type=float,
        default=50.0,
        help="a request's outputs produced within this window cross to the ingress as one message; "
        "0 sends each on its own (default: 50)",
    )
    group.add_argument(
        "--failover",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="with a separate ingress, continue a request whose LLMServer replica fails on another replica "
        "from the tokens already sent (default: on)",
    )
    group.add_argument(
        "--failover-timeout-s",
        type=float,
        default=30.0,
        help="seconds a failed replica's request waits for another replica to take it over (default: 30)",
    )
    group.add_argument(
        "--health-check-period-s",
        type=float,
        default=10.0,
        help="seconds between Serve's health checks of an LLMServer replica (default: 10)",
    )
    group.add_argument(
        "--health-check-timeout-s",
        type=float,
        default=30.0,
        help="seconds a health check may take before it fails (default: 30)",
    )
    group.add_argument(
        "--dynamic-lora-loading-path",
        metavar="FOLDER",
        help="a folder of PEFT adapter folders (needs --enable-lora): a request for "
        "'<served model name>:<adapter>' runs <FOLDER>/<adapter>, loaded by a replica on first use",
    )
    group.add_argument(
        "--max-num-adapters-per-replica",
        type=int,
        help="LoRA adapters one LLMServer replica holds at most, evicting its least recently used one "
        "(default: the engine's --max-cpu-loras, else --max-loras)",
    )


def app_args(args: argparse.Namespace, engine_settings: dict[str, Any]) -> dict[str, Any]:
    """`build_app`'s args from the parsed flags and the checked flat engine settings."""
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}")
    # Only when given: Serve takes a replica count or an autoscaling config, not both.
    replicas = {"num_replicas": args.num_replicas} if args.num_replicas is not None else {}
    return {
        **engine_settings,
        **replicas,
        "autoscaling_config": args.autoscaling_config,
        "served_model_name": args.served_model_name,
        "api_key": args.api_key,
        "max_request_body_bytes": args.max_request_body_bytes,
        "log_stats_interval": args.log_stats_interval,
        "request_timeout_s": args.request_timeout,
        "drain_timeout_s": args.drain_timeout_s,
        "enable_access_log": not args.disable_access_log,
        "enable_prompt_tokens_details": args.enable_prompt_tokens_details,
        "enable_auto_tool_choice": args.enable_auto_tool_choice,
        "tool_call_parser": args.tool_call_parser,
        "reasoning_parser": args.reasoning_parser,
        **({"ingress": args.ingress} if args.ingress else {}),
        **({"routing_policy": args.routing_policy} if args.routing_policy else {}),
        "routing_load_margin": args.routing_load_margin,
        "replica_niceness": args.replica_niceness,
        "llm_server_cpus": args.llm_server_cpus or (1.0 if args.address else float(os.cpu_count() or 1)),
        "stream_batch_interval_ms": args.stream_batch_interval_ms,
        "failover": args.failover,
        "failover_timeout_s": args.failover_timeout_s,
        "health_check_period_s": args.health_check_period_s,
        "health_check_timeout_s": args.health_check_timeout_s,
        "lora_modules": args.lora_modules,
        "dynamic_lora_loading_path": args.dynamic_lora_loading_path,
        "max_num_adapters_per_replica": args.max_num_adapters_per_replica,
        "allow_runtime_lora_updating": args.allow_runtime_lora_updating,
    }


def check_args(args: argparse.Namespace) -> None:
    """ValueError on a bad flag, before any cluster is started."""
    # With the engine flags: the LoRA flags need --enable-lora.
    parse_app_args(app_args(args, engine_settings_from_args(args)))
    cluster_env(args)


def cluster_env(args: argparse.Namespace) -> dict[str, str]:
    """The environment the local cluster starts with for --proxy-mode; ValueError when that mode
    cannot run here or a flag for a local cluster comes with --address (a joined cluster's
    settings are its own)."""
    if args.address:
        if args.proxy_mode:
            raise ValueError(
                "--proxy-mode applies to a cluster this command starts; a joined cluster keeps its own "
                "(set RAY_SERVE_ENABLE_HA_PROXY=1 or RAY_SERVE_ENABLE_DIRECT_INGRESS=1 on `ray start`)"
            )
        if args.cluster_niceness is not None:
            raise ValueError(
                "--cluster-niceness applies to a cluster this command starts; a joined cluster's "
                "processes run at the niceness they were started with"
            )
        return {}
    return proxy_env(local_proxy_mode(args))


def local_proxy_mode(args: argparse.Namespace) -> str:
    return args.proxy_mode or default_proxy_mode()


def run_serve(args: argparse.Namespace, engine_settings: dict[str, Any]) -> None:
    """Run the app until SIGINT or SIGTERM, then shut Serve (and a cluster started here) down."""
    settings_args = app_args(args, engine_settings)
    app = build_app(settings_args)
    # Before Ray (and Serve's constants) are loaded in any process of the local cluster.
    os.environ.update(cluster_env(args))
    try:
        _connect(args, settings_args)
        # After ray.init, which installs its own SIGTERM handler (it aborts the process, leaving the
        # local cluster's agents behind): both signals now interrupt start-up or the wait below.
        signal.signal(signal.SIGTERM, signal.default_int_handler)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        serve.start(http_options={"host": args.host, "port": args.port})
        serve.run(app, name=APP_NAME, route_prefix="/")
        if not args.address:
            set_cluster_priorities(
                DEFAULT_CLUSTER_NICENESS if args.cluster_niceness is None else args.cluster_niceness,
                args.replica_niceness,
                local_proxy_mode(args),
            )
        logger.info("serving on http://%s:%d until SIGINT or SIGTERM", args.host, args.port)
        threading.Event().wait()
    except KeyboardInterrupt:
        logger.info("stopping")
    finally:
        # Signals still raise KeyboardInterrupt here: a second one forces the stop.
        try:
            _stop(args)
        except KeyboardInterrupt:
            _force_stop(args)


def _stop(args: argparse.Namespace) -> None:
    """Delete the app (its replicas drain), shut Serve down, then the local cluster, and make sure
    nothing the cluster started is left."""
    if ray.is_initialized():
        # The app first, while the proxies still carry its streams: its replicas drain (for up
        # to drain_timeout_s) before they stop. Serve's own shutdown would stop the proxies at
        # the same time, cutting every stream in flight.
        logger.info("draining the app's requests in flight (a second signal stops at once)")
        serve.delete(APP_NAME)
        serve.shutdown()
    ray.shutdown()  # stops the local cluster; from a joined one it only disconnects
    if not args.address:
        # Ray stops the processes it tracks; not HAProxy, whose manager actor may die before it.
        _kill_local_cluster("left behind by the cluster's shutdown")


def _force_stop(args: argparse.Namespace) -> None:
    """Kill every process of the local cluster (all of them descendants of this one) and exit at
    once; from a joined cluster only disconnect, leaving it to finish deleting the app."""
    logger.warning("stopping at once")
    if not args.address:
        _kill_local_cluster("killed")
    logging.shutdown()
    # Not a normal exit: Ray's exit hooks would wait on the cluster just killed.
    os._exit(1)


def _kill_local_cluster(what: str) -> None:
    """SIGKILL every process this one started (and theirs), and wait until they are gone."""
    victims = kill_descendants(psutil.Process())
    if victims:
        logger.warning("%s: %s", what, ", ".join(f"{p.pid} {_name(p)}" for p in victims))
    _, alive = psutil.wait_procs(victims, timeout=FORCED_STOP_WAIT_S)
    if alive:
        logger.error("still running after SIGKILL: %s", ", ".join(str(p.pid) for p in alive))


def _name(process: psutil.Process) -> str:
    try:
        return process.name()
    except psutil.NoSuchProcess:
        return "(gone)"


def _connect(args: argparse.Namespace, settings_args: dict[str, Any]) -> None:
    if args.address:
        ray.init(address=args.address, logging_level=logging.WARNING)
        return
    num_cpus = args.num_cpus or max(os.cpu_count() or 1, required_cpus(parse_app_args(settings_args)))
    ray.init(
        address="local",
        num_cpus=num_cpus,
        object_store_memory=args.object_store_memory,
        include_dashboard=False,
        logging_level=logging.WARNING,
    )
