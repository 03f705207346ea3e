"""`raypage serve` on the head host, its engine's second pipeline stage on another host, and what
happens when that host drops off the network or dies.

The head host has two CPUs: the LLMServer replica and worker rank 0 (bundle 0 of the replica's
placement group, {CPU: 2}). Each worker host has one CPU, so rank 1 goes to one of them (SPREAD) and
the other is spare capacity. The server and the official `openai` client both run inside the head
host's network namespace (the test thread enters it), as they would on the head machine.

Ray's GCS is told to declare a node dead after about 1.5 s of failed health checks (vLLM and Ray's
defaults take about 15-30 s); the engine turns the loss of its worker into EngineDeadError naming
the rank, the node and its address, which fails the in-flight request and makes /health 503; Serve's
health check then replaces the replica, whose new placement group needs a worker host again.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Iterator

import httpx
import openai
import pytest
import yaml

from tests.cluster.remote_server import RemoteServer
from tests.model.tiny_models import write_tiny_model
from tests.multihost.netns_cluster import PROCESS_ENV, Host, NetnsCluster, entered

pytestmark = pytest.mark.slow

MODEL = "served-model"
PROMPT = "The capital of France is"
HEAD = Host("head", 1, num_cpus=2)
WORKER_HOSTS = [
    Host("w1", 2, num_cpus=1, resources={"w1": 1}),
    Host("w2", 3, num_cpus=1, resources={"w2": 1}),
]
# GCS health checks of every raylet: every 0.5 s, 0.5 s to answer, dead after 3 misses.
RAY_HEALTH = {
    "RAY_health_check_initial_delay_ms": "0",
    "RAY_health_check_period_ms": "500",
    "RAY_health_check_timeout_ms": "500",
    "RAY_health_check_failure_threshold": "3",
}
ENGINE = {
    "dtype": "float32",
    "max_model_len": 512,
    "num_kv_blocks": 64,
    "distributed_executor_backend": "ray",
    "pipeline_parallel_size": 2,
    "placement_strategy": "SPREAD",
}
FAILURE_GOAL_S = 10.0  # from the fault to the client's error (the goal)
RECOVERY_TIMEOUT_S = 180.0  # a cap for a broken cluster; recovery is not timed
NODE_ERROR = re.compile(r"Ray worker rank \d \(node \w+ at (198\.18\.0\.\d+)\) died")


@pytest.fixture(scope="module")
def cluster() -> Iterator[NetnsCluster]:
    with NetnsCluster([HEAD, *WORKER_HOSTS], ray_env=RAY_HEALTH) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def server(cluster: NetnsCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RemoteServer]:
    folder = tmp_path_factory.mktemp("serve-hosts")
    model = write_tiny_model(folder / "model")
    engine_file = folder / "engine.yaml"
    engine_file.write_text(yaml.safe_dump({"model": str(model), **ENGINE}))
    flags = [
        *("--address", cluster.address, "--served-model-name", MODEL, "--config", str(engine_file)),
        *("--llm-server-cpus", "1", "--health-check-period-s", "1", "--health-check-timeout-s", "5"),
    ]
    saved = dict(os.environ)
    os.environ.update(PROCESS_ENV)
    try:
        # Started from the head host's namespace, the server and its engine run there.
        with entered(HEAD.namespace):
            server = RemoteServer(flags, folder / "serve.log", command="serve", stop_timeout_s=60)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    yield server
    server.stop()


def client_for(server: RemoteServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)


def completes(server: RemoteServer) -> bool:
    chunks = client_for(server).completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0.0, stream=True
    )
    return [chunk.choices[0].finish_reason for chunk in chunks if chunk.choices][-1] == "length"


def health(server: RemoteServer) -> int | str:
    try:
        return httpx.get(server.base_url + "/health", timeout=5).status_code
    except httpx.HTTPError as exc:
        return type(exc).__name__


def wait_until_serving(server: RemoteServer) -> None:
    deadline = time.monotonic() + RECOVERY_TIMEOUT_S
    while health(server) != 200:
        assert time.monotonic() < deadline, (
            f"no healthy replica in {RECOVERY_TIMEOUT_S:.0f} s:\n{server.log_tail()}"
        )
        time.sleep(1)
    assert completes(server)


def stage_host(cluster: NetnsCluster) -> str:
    """The worker host that runs pipeline stage 1 (the only Ray worker actor off the head host)."""
    (host,) = [name for name in cluster.hosts_running("RayWorker") if name != HEAD.name]
    return host


def lose_stage_host(cluster: NetnsCluster, server: RemoteServer, fault: str) -> str:
    """Start a long stream, and once tokens flow apply `fault` ("partition" or "kill_node") to the
    host of stage 1: the stream must fail within the goal, its error naming that host, and /health
    must say so. The lost host's name."""
    lost = stage_host(cluster)
    stream = iter(
        client_for(server).completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=480, temperature=0.0, stream=True
        )
    )
    next(stream)  # generating now
    started = time.monotonic()
    getattr(cluster, fault)(lost)
    with pytest.raises((openai.APIError, httpx.HTTPError)) as error:
        for _ in stream:
            pass
    took = time.monotonic() - started
    status = health(server)
    print(f"\n{fault} of {lost}: the stream failed after {took:.1f} s ({error.value}); /health {status}")
    assert took < FAILURE_GOAL_S
    found = NODE_ERROR.search(str(error.value))
    assert found and found.group(1) == cluster.hosts[lost].ip, str(error.value)
    assert status != 200
    return lost


def test_partitioned_host_fails_the_stream_naming_it_then_serving_resumes(
    cluster: NetnsCluster, server: RemoteServer
) -> None:
    with entered(HEAD.namespace):
        assert completes(server)
        lost = lose_stage_host(cluster, server, "partition")
    # Ray declared the partitioned node dead: its raylet does not come back with the link. The
    # machine rejoins as a new node (as a restarted VM or pod would).
    cluster.heal(lost)
    cluster.kill_node(lost)
    cluster.start_node(lost)
    with entered(HEAD.namespace):
        wait_until_serving(server)


def test_killed_host_fails_the_stream_and_serve_recovers_on_the_other(
    cluster: NetnsCluster, server: RemoteServer
) -> None:
    with entered(HEAD.namespace):
        wait_until_serving(server)
        lost = lose_stage_host(cluster, server, "kill_node")
        # The other worker host is the remaining capacity for stage 1 of a new replica.
        wait_until_serving(server)
    assert stage_host(cluster) != lost
