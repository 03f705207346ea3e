"""A local multi-node Ray cluster for one test module, checked for leaked processes when it stops."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import psutil
import ray
from ray.cluster_utils import Cluster


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
