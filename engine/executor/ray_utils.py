"""Where the Ray executor's workers go: joining a cluster, reserving a placement group, ranking workers.

One bundle per worker: `{"GPU": 1}` on CUDA, `{"CPU": 1}` on the CPU, or `placement_bundle`. A Serve
replica reserves the group itself (its own resources merged into bundle 0, see
cluster/serve/replica_bundles.py), and the engine it holds finds that group (`inherit_ray_context`);
anywhere else the executor creates one and waits for it a bounded time, naming the resources the
cluster lacks instead of waiting forever.

Ranks: rank = pp_stage * tp_size + tp_rank, so each run of tp_size consecutive ranks is one tensor-
parallel group, whose all-reduces run every layer and must stay on one node. Workers are ranked
driver node first (where the scheduler runs), then node by node, which keeps each TP group on one
node whenever every node's worker count is a multiple of tp_size.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections import Counter
from collections.abc import Sequence

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.placement_group import get_current_placement_group as ray_current_placement_group

from engine.config import EngineConfig, ParallelConfig

logger = logging.getLogger(__name__)

# Ray's own reservation for a local cluster's object store is 30% of memory: the engine only ships
# scheduler messages and sampled tokens through it (tensors between stages go over torch.distributed).
LOCAL_OBJECT_STORE_BYTES = 256 * 1024 * 1024


def worker_bundle(config: EngineConfig) -> dict[str, float]:
    """The resources of one worker's bundle."""
    if config.parallel.placement_bundle is not None:
        return dict(config.parallel.placement_bundle)
    return {"GPU": 1.0} if config.model.device == "cuda" else {"CPU": 1.0}


def connect(address: str | None) -> None:
    """Join the cluster at `address`; with None, join a running one, else start a local one.

    ray.init replaces the process's SIGTERM handler with one that dumps a stack trace; the caller's
    own (the engine core's clean exit) is put back."""
    if ray.is_initialized():
        return
    in_main_thread = threading.current_thread() is threading.main_thread()
    on_sigterm = signal.getsignal(signal.SIGTERM)
    try:
        _init(address)
    finally:
        if in_main_thread and on_sigterm is not None:
            signal.signal(signal.SIGTERM, on_sigterm)


def _init(address: str | None) -> None:
    if address is not None:
        ray.init(address=address, logging_level=logging.WARNING)
        return
    try:
        ray.init(address="auto", logging_level=logging.WARNING)
    except ConnectionError:
        logger.info("No Ray cluster is running: starting a local one")
        ray.init(
            num_cpus=os.cpu_count(),
            object_store_memory=LOCAL_OBJECT_STORE_BYTES,
            include_dashboard=False,
            logging_level=logging.WARNING,
        )


def inherit_ray_context(config: EngineConfig) -> EngineConfig:
    """The config for an engine core that this process starts in another one: join (or start) the
    cluster here, where the caller may already be connected, and hand the core its address and the
    placement group this process runs in (a Serve replica's), so that the core joins the same cluster
    and places its workers there."""
    parallel = config.parallel
    connect(parallel.ray_address)
    updates: dict[str, str | None] = {"ray_address": ray.get_runtime_context().gcs_address}
    if parallel.placement_group_id is None:
        updates["placement_group_id"] = current_placement_group_id()
    return config.model_copy(update={"parallel": parallel.model_copy(update=updates)})


def current_placement_group_id() -> str | None:
    """The hex id of the placement group this process runs in (a Serve replica's), or None."""
    group = ray_current_placement_group() if ray.is_initialized() else None
    return None if group is None else group.id.hex()


def placement_group_by_id(group_id: str) -> PlacementGroup:
    from ray._raylet import PlacementGroupID

    return PlacementGroup(PlacementGroupID(bytes.fromhex(group_id)))


def reserve_placement_group(parallel: ParallelConfig, bundle: dict[str, float]) -> PlacementGroup:
    """A new group of world_size bundles, granted within placement_timeout_s or removed with an error
    naming what the cluster lacks."""
    bundles = [dict(bundle) for _ in range(parallel.world_size)]
    group = placement_group(bundles, strategy=parallel.placement_strategy, name="")
    ready, _ = ray.wait([group.ready()], timeout=parallel.placement_timeout_s)
    if ready:
        return group
    remove_placement_group(group)
    raise TimeoutError(
        f"the Ray cluster did not grant {parallel.world_size} worker bundles of {bundle} "
        f"(placement_strategy {parallel.placement_strategy}) within placement_timeout_s="
        f"{parallel.placement_timeout_s:g}: {_shortfall(bundles)}"
    )


def _shortfall(bundles: Sequence[dict[str, float]]) -> str:
    """What the cluster lacks for `bundles`, by resource name."""
    needed: Counter[str] = Counter()
    for bundle in bundles:
        needed.update(bundle)
    available = ray.available_resources()
    total = ray.cluster_resources()
    missing = [
        f"{name} needs {amount:g}, {available.get(name, 0):g} of {total.get(name, 0):g} available"
        for name, amount in sorted(needed.items())
        if available.get(name, 0) < amount
    ]
    if missing:
        return "; ".join(missing)
    return f"the totals are available ({dict(needed)}), but not in the layout the strategy requires"


def rank_order(bundle_nodes: Sequence[str], driver_node: str, tp_size: int) -> list[int]:
    """Bundle indices in rank order: the driver node's workers first, then node by node (in the order
    nodes first appear among the bundles). Warns when a tensor-parallel group spans nodes."""
    first_seen = {node: position for position, node in reversed(list(enumerate(bundle_nodes)))}
    order = sorted(
        range(len(bundle_nodes)),
        key=lambda index: (bundle_nodes[index] != driver_node, first_seen[bundle_nodes[index]], index),
    )
    for start in range(0, len(order), tp_size):
        nodes = {bundle_nodes[index] for index in order[start : start + tp_size]}
        if len(nodes) > 1:
            logger.warning(
                "tensor-parallel ranks %d-%d span %d nodes (%s): their per-layer all-reduces cross the "
                "network; give every node a multiple of tensor_parallel_size=%d workers to avoid it",
                start,
                start + tp_size - 1,
                len(nodes),
                ", ".join(sorted(node[:8] for node in nodes)),
                tp_size,
            )
    return order
