"""A local multi-node Ray cluster for one test module, checked for leaked processes when it stops."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import psutil
import pytest
import ray
from ray import serve
from ray.cluster_utils import Cluster

from tests.cluster.remote_server import free_port


@contextlib.contextmanager
def local_cluster(**head_node_args: Any) -> Iterator[Cluster]:
    """A `ray.cluster_utils.Cluster` (head node only; add nodes with `add_node`) that this process
    is connected to. On exit it is shut down, and any process it started that outlives that (a
    raylet, an actor, an engine core) is killed and fails the test."""
    cluster = Cluster(initialize_head=True, head_node_args=head_node_args)
    ray.init(address=cluster.address)
    started = psutil.Process().children(recursive=True)
    yield cluster
    descendants = started + psutil.Process().children(recursive=True)
    ray.shutdown()
    cluster.shutdown()
    _, alive = psutil.wait_procs(descendants, timeout=30)
    leaked = [(process.pid, " ".join(process.cmdline())[:80]) for process in alive if process.is_running()]
    for process in alive:
        process.kill()
    assert not leaked, f"processes left behind: {leaked}"


@contextlib.contextmanager
def serve_on_local_cluster(num_cpus: int) -> Iterator[str]:
    """Serve's HTTP proxy on a free loopback port of a local cluster of `num_cpus` CPUs (a 100 MB
    object store, no dashboard): its base URL. Serve shuts down before the cluster does."""
    with local_cluster(num_cpus=num_cpus, object_store_memory=100 * 1024 * 1024, include_dashboard=False):
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        try:
            yield f"http://127.0.0.1:{port}"
        finally:
            serve.shutdown()


def serve_url_fixture(num_cpus: int) -> Any:
    """A module-scoped fixture of `serve_on_local_cluster(num_cpus)`'s URL, for `base_url = ...`."""

    @pytest.fixture(scope="module")
    def base_url() -> Iterator[str]:
        with serve_on_local_cluster(num_cpus) as url:
            yield url

    return base_url
