"""A Serve replica's placement group, for an engine whose workers are Ray actors.

The replica reserves the group itself, so that its engine's workers start beside it; the engine
finds the group it runs in (engine/executor/ray_utils.py) instead of reserving one of its own.
"""

from __future__ import annotations

from engine.config import EngineConfig
from engine.executor.ray_utils import worker_bundle


def replica_bundles(config: EngineConfig, replica_resources: dict[str, float]) -> list[dict[str, float]]:
    """The replica's own resources merged into bundle 0 (worker rank 0's), then one bundle per
    further worker."""
    bundle = worker_bundle(config)
    first = dict(bundle)
    for name, amount in replica_resources.items():
        if amount:
            first[name] = first.get(name, 0.0) + amount
    return [first] + [dict(bundle) for _ in range(config.parallel.world_size - 1)]
