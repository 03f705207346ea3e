"""Collectives over the tensor-parallel group (no-ops at group size 1), and the time they take.

Every collective and pipeline send/receive adds its wall time to `COMM_TIMES` (seconds and calls
per operation), which `raypage bench throughput` reads from each worker to report communication
as a share of the step. It is this module's only state, one per worker process.
"""

from __future__ import annotations

import collections
import contextlib
import time
from collections.abc import Iterator

import torch
import torch.distributed as dist

from parallel.state import get_parallel_state

COMM_TIMES: collections.defaultdict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0])


@contextlib.contextmanager
def timed(operation: str) -> Iterator[None]:
    start = time.perf_counter()
    try:
        yield
    finally:
        totals = COMM_TIMES[operation]
        totals[0] += time.perf_counter() - start
        totals[1] += 1


def take_comm_times() -> dict[str, tuple[float, int]]:
    """(seconds, calls) per operation since the last call, and start counting afresh."""
    taken = {operation: (seconds, int(calls)) for operation, (seconds, calls) in COMM_TIMES.items()}
    COMM_TIMES.clear()
    return taken


def tensor_parallel_all_reduce(tensor: torch.Tensor) -> torch.Tensor:
    """Sum a tensor over the TP group, in place."""
    state = get_parallel_state()
    if state.tp_size > 1:
        with timed("all_reduce"):
            dist.all_reduce(tensor, group=state.tp_group)
    return tensor


def tensor_parallel_all_gather(tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate each rank's tensor along `dim`, in rank order."""
    state = get_parallel_state()
    if state.tp_size == 1:
        return tensor
    parts = [torch.empty_like(tensor) for _ in range(state.tp_size)]
    with timed("all_gather"):
        dist.all_gather(parts, tensor.contiguous(), group=state.tp_group)
    return torch.cat(parts, dim=dim)
