"""The Ray Serve front door: `raypage serve` (a real subprocess, joined to this module's local Ray
cluster) with the Ray executor at TP=2, exercised with the official openai client; a killed worker
actor and the replica Serve puts in its place; the args parser on every Serve config file. The
separate ingress on a cluster of its own is test_serve_own_cluster.py's, apart from this module's
cluster, which would otherwise run beside it until this module ends."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import psutil
import pytest
import ray
import yaml
from ray.cluster_utils import Cluster
from ray.serve.schema import ServeDeploySchema

from cluster.cli import build_parser, main
from cluster.serve import proxy_mode
from cluster.serve.args import parse_app_args, parse_app_models
from cluster.serve.command import app_args
from cluster.serve_app import build_app, llm_server_options, required_cpus
from tests.cluster.local_ray_cluster import local_cluster
from tests.cluster.remote_server import REPO_ROOT, RemoteServer
from tests.cluster.serve_checks import (
    API_KEY,
    MODEL,
    PROMPT,
    assert_a_closed_stream_aborts,
    assert_serves_greedy_texts,
    engine_flags,
    processes_titled,
)
from tests.structured.checks import assert_forced_tool_calls, assert_json_schema_reply, in_parallel
from tests.structured.schemas import SCHEMAS

# Two logical CPUs per extra replica: Serve may start a replacement before the old one is gone.
CLUSTER_CPUS = 8
DEATH_NOTICE_S = 10.0  # how long a killed worker may take to fail the in-flight request
REPLACEMENT_TIMEOUT_S = 120.0


def health(base_url: str) -> int | None:
    try:
        return httpx.get(base_url + "/health", timeout=5).status_code
    except httpx.TransportError:
        return None


def wait_for_health(base_url: str, status: int, timeout_s: float) -> float:
    """Seconds until GET /health answers `status`; TimeoutError after `timeout_s`."""
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        if health(base_url) == status:
            return time.monotonic() - started
        time.sleep(0.2)
    raise TimeoutError(f"/health did not answer {status} within {timeout_s:.0f} s")


def gone(process: psutil.Process) -> bool:
    try:
        return process.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


# ---- the args parser, without a cluster -----------------------------------------------------------


@pytest.mark.parametrize(
    "path", sorted((REPO_ROOT / "configs" / "serve").glob("*.yaml")), ids=lambda p: p.name
)
def test_every_serve_config_file_validates(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO_ROOT)  # engine files are named relative to the root, where `serve run` runs
    schema = ServeDeploySchema(**yaml.safe_load(path.read_text()))
    assert schema.applications
    for app in schema.applications:
        assert app.import_path == "cluster.serve_app:build_app"
        for settings in parse_app_models(app.args):
            assert settings.server.served_model_names


def test_app_args_override_the_engine_file_and_name_bad_keys() -> None:
    engine_file = REPO_ROOT / "configs" / "engine" / "smollm2.yaml"
    settings = parse_app_args({"config": str(engine_file), "max_model_len": 256, "api_key": "k"})
    assert settings.engine_config.model.max_model_len == 256  # the args win over the file
    assert settings.engine_config.cache.kv_cache_memory == 1 << 30  # the file wins over the default
    assert settings.server.api_key == "k"
    assert settings.server.served_model_names == ["SmolLM2-135M-Instruct"]
    with pytest.raises(ValueError, match="'max_num_seq'"):
        parse_app_args({"max_num_seq": 4})
    with pytest.raises(ValueError, match="max_num_seqs: Input should be greater than 0"):
        parse_app_args({"config": str(engine_file), "max_num_seqs": 0})
    with pytest.raises(ValueError, match="health_check_period_s"):
        parse_app_args({"health_check_period_s": -1})


def test_reasoning_parser_is_a_serve_flag_and_an_app_key() -> None:
    args = build_parser().parse_args(["serve", "--reasoning-parser", "qwen3"])
    assert parse_app_args(app_args(args, {})).server.reasoning_parser == "qwen3"
    with pytest.raises(ValueError, match="unknown reasoning parser 'r1'; known parsers: deepseek_r1, qwen3"):
        parse_app_args({"reasoning_parser": "r1"})


def test_ray_backend_reserves_one_bundle_per_worker_with_the_replica_in_the_first() -> None:
    options = llm_server_options(
        parse_app_args(
            {"distributed_executor_backend": "ray", "tensor_parallel_size": 2, "llm_server_cpus": 1}
        )
    )
    assert options["placement_group_bundles"] == [{"CPU": 2.0}, {"CPU": 1.0}]
    assert options["placement_group_strategy"] == "PACK"
    assert options["ray_actor_options"] == {"num_cpus": 1}
    assert "placement_group_bundles" not in llm_server_options(parse_app_args({"tensor_parallel_size": 1}))


def test_one_llm_server_deployment_is_the_ingress_unless_asked_for_a_separate_one() -> None:
    engine = build_app({})._bound_deployment
    assert engine.name == "LLMServer"
    assert hasattr(engine.func_or_class, "__serve_build_asgi_app__")  # it serves the OpenAI app itself
    assert required_cpus(parse_app_args({"llm_server_cpus": 2})) == 2.0

    ingress = build_app({"ingress": "separate"})._bound_deployment
    assert ingress.name == "OpenAIIngress"
    ((llm_server, _, names),) = ingress.init_args[0]
    assert names == ["SmolLM2-135M-Instruct"]
    assert llm_server._bound_deployment.name == "LLMServer"
    assert not hasattr(llm_server._bound_deployment.func_or_class, "__serve_build_asgi_app__")
    assert required_cpus(parse_app_args({"llm_server_cpus": 2, "ingress": "separate"})) == 3.0
    with pytest.raises(ValueError, match="ingress"):
        parse_app_args({"ingress": "both"})


def test_autoscaling_config_goes_to_serve_checked_by_its_schema() -> None:
    autoscaling = {"min_replicas": 1, "max_replicas": 3, "target_ongoing_requests": 8}
    settings = parse_app_args({"autoscaling_config": autoscaling, "llm_server_cpus": 2})
    options = llm_server_options(settings)
    assert options["autoscaling_config"] == autoscaling and "num_replicas" not in options
    # Room for every replica it may scale to, and their ingress (a separate one, routing between them).
    assert settings.options.ingress == "separate" and settings.options.routing_policy == "kv_aware"
    assert required_cpus(settings) == 3 * 2.0 + 1.0
    with pytest.raises(ValueError, match=r"autoscaling_config: unknown key.*'max_replica'"):
        parse_app_args({"autoscaling_config": {"max_replica": 2}})
    with pytest.raises(ValueError, match=r"max_replicas \(2\) must be greater than or equal to min_replicas"):
        parse_app_args({"autoscaling_config": {"min_replicas": 3, "max_replicas": 2}})
    with pytest.raises(ValueError, match="set num_replicas or autoscaling_config, not both"):
        parse_app_args({"autoscaling_config": autoscaling, "num_replicas": 2})


def test_several_models_get_one_ingress_and_a_deployment_each() -> None:
    args = {
        "max_model_len": 256,  # every model's default
        "api_key": "k",
        "models": [
            {"served_model_name": "a", "num_replicas": 2},
            {
                "served_model_name": ["b", "b2"],
                "max_model_len": 128,
                "autoscaling_config": {"max_replicas": 3},
            },
        ],
    }
    first, second = parse_app_models(args)
    assert first.engine_config.model.max_model_len == 256 and second.engine_config.model.max_model_len == 128
    assert first.server.api_key == second.server.api_key == "k"
    ingress = build_app(args)._bound_deployment
    assert ingress.name == "OpenAIIngress"
    servers = [(handle._bound_deployment, names) for handle, _, names in ingress.init_args[0]]
    assert [(server.name, names) for server, names in servers] == [
        ("LLMServer:a", ["a"]),
        ("LLMServer:b", ["b", "b2"]),
    ]
    assert servers[0][0]._deployment_config.num_replicas == 2
    assert servers[1][0]._deployment_config.autoscaling_config.max_replicas == 3
    with pytest.raises(ValueError, match=r"models\[0\]: 'api_key' are the app's keys"):
        parse_app_models({"models": [{"api_key": "k"}]})
    with pytest.raises(ValueError, match="'num_replicas' belong to each entry of 'models'"):
        parse_app_models({"num_replicas": 2, "models": [{}]})
    with pytest.raises(ValueError, match="'a' name more than one model"):
        parse_app_models({"models": [{"served_model_name": "a"}, {"served_model_name": "a"}]})
    with pytest.raises(ValueError, match=r"models\[1\]: .*max_num_seq"):
        parse_app_models({"models": [{"served_model_name": "a"}, {"max_num_seq": 4}]})
    with pytest.raises(ValueError, match="needs ingress: separate"):
        parse_app_models({"ingress": "engine", "models": [{}]})


def test_haproxy_mode_is_the_default_where_serve_finds_haproxy_and_a_clear_error_where_not(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    assert proxy_mode.proxy_env("python") == {}
    monkeypatch.setattr(proxy_mode, "haproxy_available", lambda: True)
    assert proxy_mode.default_proxy_mode() == "haproxy"
    assert proxy_mode.proxy_env("haproxy")["RAY_SERVE_ENABLE_HA_PROXY"] == "1"
    monkeypatch.setattr(proxy_mode, "haproxy_available", lambda: False)
    assert proxy_mode.default_proxy_mode() == "python"
    with pytest.raises(SystemExit) as exited:
        main(["serve", "--proxy-mode", "haproxy"])
    assert exited.value.code == 2
    assert "--proxy-mode haproxy needs an HAProxy binary" in capsys.readouterr().err
    # A joined cluster's proxy is the one it was started with.
    with pytest.raises(SystemExit):
        main(["serve", "--address", "127.0.0.1:6379", "--proxy-mode", "python"])
    assert "a joined cluster keeps its own" in capsys.readouterr().err


def test_cluster_niceness_is_for_a_local_cluster_and_from_0_to_19(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["serve", "--cluster-niceness", "20"])
    assert exited.value.code == 2
    assert "argument --cluster-niceness: invalid choice: 20" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exited:
        main(["serve", "--address", "127.0.0.1:6379", "--cluster-niceness", "19"])
    assert exited.value.code == 2
    assert "--cluster-niceness applies to a cluster this command starts" in capsys.readouterr().err


def test_serve_rejects_a_bad_flag_before_starting_anything(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["serve", "--health-check-period-s", "0"])
    assert exited.value.code == 2
    assert "health_check_period_s: Input should be greater than 0" in capsys.readouterr().err


# ---- end to end on a local Ray cluster ----------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    with local_cluster(
        num_cpus=CLUSTER_CPUS, object_store_memory=100 * 1024 * 1024, include_dashboard=False
    ) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def server(
    cluster: Cluster, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RemoteServer]:
    flags = [
        *("--served-model-name", MODEL, "--api-key", API_KEY),
        *("--tensor-parallel-size", "2", "--distributed-executor-backend", "ray"),
        # The model drafting itself (whole, on the first worker, beside its half of the target).
        *("--speculative-config", json.dumps({"model": str(tiny_model), "num_speculative_tokens": 2})),
        # Short health checks, so that a replica whose engine died is replaced within seconds.
        *("--health-check-period-s", "1", "--health-check-timeout-s", "5"),
        *engine_flags(tiny_model),
    ]
    server = RemoteServer(
        ["--address", cluster.address, *flags],
        tmp_path_factory.mktemp("serve") / "serve.log",
        command="serve",
        stop_timeout_s=60,
    )
    yield server
    assert server.stop() == 0, server.log_tail()


@pytest.fixture(scope="module")
def client(server: RemoteServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


@pytest.mark.slow
def test_completions_and_chat_match_the_offline_engine(
    server: RemoteServer, client: openai.OpenAI, expected: dict[str, str]
) -> None:
    assert_serves_greedy_texts(client, expected)
    assert [model.id for model in client.models.list()] == [MODEL]
    # The drafts verified by the replica's engine reach the ingress's /metrics at its next refresh.
    deadline = time.monotonic() + 15
    while server.metric("raypage:spec_decode_num_accepted_tokens_total") == 0:
        assert time.monotonic() < deadline, "no accepted drafts in /metrics"
        time.sleep(0.5)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.base_url + "/v1", api_key="wrong", max_retries=0).models.list()


@pytest.mark.slow
def test_structured_outputs_and_tool_calls_through_serve(client: openai.OpenAI) -> None:
    # The grammar's masks cross the Ray executor to both tensor-parallel workers. The checks' requests
    # go at once, so that the replica's engine batches them; each is checked as it would be alone.
    in_parallel(
        [
            lambda: assert_json_schema_reply(client, MODEL, SCHEMAS[2].schema, stream=False),
            lambda: assert_json_schema_reply(client, MODEL, SCHEMAS[5].schema, stream=True),
            lambda: assert_forced_tool_calls(client, MODEL, seeds=range(1)),
        ]
    )


@pytest.mark.slow
def test_workers_run_in_the_replicas_placement_group(server: RemoteServer) -> None:
    groups = [group for group in ray.util.placement_group_table().values() if group["state"] == "CREATED"]
    assert len(groups) == 1, "the executor must use the replica's group, not reserve its own"
    assert list(groups[0]["bundles"].values()) == [{"CPU": 2.0}, {"CPU": 1.0}]
    assert len(processes_titled("ray::RayWorker")) == 2


@pytest.mark.slow
def test_a_closed_stream_aborts_its_request(server: RemoteServer, client: openai.OpenAI) -> None:
    assert_a_closed_stream_aborts(server.base_url, client)


@pytest.mark.slow
def test_killed_worker_fails_the_request_and_serve_replaces_the_replica(
    server: RemoteServer, client: openai.OpenAI, expected: dict[str, str]
) -> None:
    workers = processes_titled("ray::RayWorker")
    replicas = processes_titled("ray::ServeReplica:raypage:LLMServer")
    assert len(workers) == 2 and len(replicas) == 1
    stream = iter(
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=480, temperature=0.0, stream=True)
    )
    next(stream)  # generating now
    killed_at = time.monotonic()
    workers[1].kill()
    with pytest.raises(
        openai.APIError, match=r"The engine is not running: .*Ray worker rank \d \(node \w+ at [\d.]+\) died"
    ):
        for _ in stream:
            pass
    assert time.monotonic() - killed_at < DEATH_NOTICE_S
    # /health says so until Serve has replaced the replica (after three failed checks a second apart).
    assert wait_for_health(server.base_url, 503, DEATH_NOTICE_S) < DEATH_NOTICE_S
    wait_for_health(server.base_url, 200, REPLACEMENT_TIMEOUT_S)

    assert_serves_greedy_texts(client, expected)
    assert all(gone(process) for process in workers + replicas)
    new_workers = processes_titled("ray::RayWorker")
    assert len(new_workers) == 2 and not {p.pid for p in new_workers} & {p.pid for p in workers}
    assert len(processes_titled("ray::ServeReplica:raypage:LLMServer")) == 1
