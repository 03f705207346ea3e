"""A Ray node removed under `raypage serve` while a streaming client is mid-stream.

The test's local cluster has a head node (Serve's controller and proxy) and a second raylet whose
custom resource every worker bundle asks for, so the LLMServer replica (which shares worker rank 0's
bundle) and its worker run there. Removing that node fails the stream at once; Serve replaces the
replica as soon as the cluster has a node for it again (here the test adds one, as KubeRay or the
autoscaler would), and requests then succeed with no restart of `raypage serve`.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import openai
import pytest
import ray
import yaml
from ray.cluster_utils import Cluster

from tests.cluster.local_ray_cluster import local_cluster
from tests.cluster.remote_server import RemoteServer
from tests.model.tiny_models import write_tiny_model

pytestmark = pytest.mark.slow

MODEL = "served-model"
PROMPT = "The capital of France is"
NODE_RESOURCE = "raypage_worker_node"
OBJECT_STORE_BYTES = 100 * 1024 * 1024
# Worker rank 0's CPU and the replica's own: the node holds exactly one replica.
WORKER_NODE_CPUS = 2
ENGINE = {
    "dtype": "float32",
    "max_model_len": 512,
    "num_kv_blocks": 64,
    "distributed_executor_backend": "ray",
    "placement_bundle": {"CPU": 1, NODE_RESOURCE: 1},
}
# Caps that only keep a broken cluster from hanging the test; nothing here is timed.
DEATH_NOTICE_S = 30.0
REPLACEMENT_TIMEOUT_S = 180.0


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    with local_cluster(
        num_cpus=2,
        object_store_memory=OBJECT_STORE_BYTES,
        include_dashboard=False,
        # Notice a removed node within about three seconds.
        _system_config={"health_check_period_ms": 1000, "health_check_failure_threshold": 3},
    ) as cluster:
        yield cluster


def add_worker_node(cluster: Cluster) -> str:
    """A raylet that offers the workers' resource; its node id."""
    node = cluster.add_node(
        num_cpus=WORKER_NODE_CPUS, resources={NODE_RESOURCE: 1}, object_store_memory=OBJECT_STORE_BYTES
    )
    return node.node_id


@pytest.fixture(scope="module")
def server(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RemoteServer]:
    folder = tmp_path_factory.mktemp("serve-node-loss")
    model = write_tiny_model(folder / "model")
    engine_file = folder / "engine.yaml"
    engine_file.write_text(yaml.safe_dump({"model": str(model), **ENGINE}))
    add_worker_node(cluster)
    flags = [
        *("--address", cluster.address, "--served-model-name", MODEL, "--config", str(engine_file)),
        *("--llm-server-cpus", "1", "--health-check-period-s", "1", "--health-check-timeout-s", "5"),
    ]
    server = RemoteServer(flags, folder / "serve.log", command="serve", stop_timeout_s=60)
    yield server
    server.stop()


def replica_node() -> str:
    """The node of the one placement group's first bundle: the LLMServer replica's."""
    groups = [group for group in ray.util.placement_group_table().values() if group["state"] == "CREATED"]
    assert len(groups) == 1, groups
    return groups[0]["bundles_to_node_id"][0]


def health(server: RemoteServer, timeout_s: float = 2.0) -> int | str:
    """The status of GET /health, or what went wrong."""
    try:
        return httpx.get(server.base_url + "/health", timeout=timeout_s).status_code
    except httpx.HTTPError as exc:
        return type(exc).__name__


def completes(client: openai.OpenAI) -> bool:
    chunks = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0.0, stream=True
    )
    return [chunk.choices[0].finish_reason for chunk in chunks if chunk.choices][-1] == "length"


def test_removed_node_fails_the_stream_and_serve_replaces_the_replica(
    cluster: Cluster, server: RemoteServer
) -> None:
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)
    assert completes(client)
    (doomed,) = [node for node in cluster.worker_nodes if node.node_id == replica_node()]

    stream = iter(
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=480, temperature=0.0, stream=True)
    )
    next(stream)  # generating now
    removed_at = time.monotonic()
    cluster.remove_node(doomed, allow_graceful=False)
    with pytest.raises((openai.APIError, httpx.HTTPError)) as error:
        for _ in stream:
            pass
    failed_after = time.monotonic() - removed_at
    assert failed_after < DEATH_NOTICE_S
    # The dying replica may still answer for a moment; then Serve's proxy holds requests while the
    # deployment has no replica.
    deadline = time.monotonic() + DEATH_NOTICE_S
    while (unhealthy := health(server, timeout_s=5)) == 200:
        assert time.monotonic() < deadline, "/health still answers 200"
        time.sleep(0.5)
    print(f"\nthe stream failed in {failed_after:.1f} s: {error.value!r}; /health: {unhealthy}")

    # No node can take the replacement replica until one with the resource joins.
    add_worker_node(cluster)
    deadline = time.monotonic() + REPLACEMENT_TIMEOUT_S
    while health(server) != 200:
        assert time.monotonic() < deadline, (
            f"no replica in {REPLACEMENT_TIMEOUT_S:.0f} s:\n{server.log_tail()}"
        )
        time.sleep(1)
    # Only the new node offers the resource, so a replica that serves runs there.
    assert completes(client)
