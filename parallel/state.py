"""This process's place in the world: its tensor-parallel and pipeline-parallel ranks and groups.

Ranks are laid out so that a tensor-parallel group is contiguous: rank = pp_rank * tp_size + tp_rank.
A worker calls `init_model_parallel` once before building its model; layers read the result with
`get_parallel_state()`. A process that never calls it is a single rank (tp_size = pp_size = 1), and
then no torch.distributed group exists at all.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

import torch
import torch.distributed as dist


@dataclasses.dataclass(frozen=True)
class ParallelState:
    """Ranks and process groups of one worker."""

    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    tp_group: dist.ProcessGroup | None = None
    pp_group: dist.ProcessGroup | None = None
    # Mixture-of-experts layers split their experts over the TP group instead of each expert's
    # weights (engine/models/moe.py).
    enable_expert_parallel: bool = False

    @property
    def rank(self) -> int:
        return self.pp_rank * self.tp_size + self.tp_rank

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def is_driver(self) -> bool:
        """The rank whose output the scheduler reads: TP rank 0 of the last stage."""
        return self.is_last_stage and self.tp_rank == 0


_state = ParallelState()


def get_parallel_state() -> ParallelState:
    return _state


def init_model_parallel(
    tp_size: int,
    pp_size: int,
    rank: int,
    init_method: str | None = None,
    device: torch.device | None = None,
    enable_expert_parallel: bool = False,
) -> ParallelState:
    """Join the world (when it has more than one rank) and build the TP and PP groups.

    The backend follows the worker's device, not the machine: NCCL for a CUDA device (bound to it,
    so that NCCL sets up its communicator on this rank's GPU and no other), gloo otherwise, so a
    CPU engine on a machine with a GPU keeps gloo.
    """
    global _state
    world_size = tp_size * pp_size
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside a world of {world_size}")
    tp_group = pp_group = None
    if world_size > 1:
        if not dist.is_initialized():
            if init_method is None:
                raise ValueError("a world of several ranks needs an init_method (tcp://host:port)")
            on_cuda = device is not None and device.type == "cuda"
            dist.init_process_group(
                "nccl" if on_cuda else "gloo",
                init_method=init_method,
                world_size=world_size,
                rank=rank,
                device_id=device if on_cuda else None,
            )
        # Every rank must create every group, in the same order.
        for pp in range(pp_size):
            ranks = list(range(pp * tp_size, (pp + 1) * tp_size))
            group = dist.new_group(ranks)
            if rank in ranks:
                tp_group = group
        for tp in range(tp_size):
            ranks = list(range(tp, world_size, tp_size))
            group = dist.new_group(ranks)
            if rank in ranks:
                pp_group = group
    _state = ParallelState(
        rank % tp_size, tp_size, rank // tp_size, pp_size, tp_group, pp_group, enable_expert_parallel
    )
    return _state


@contextlib.contextmanager
def single_rank() -> Iterator[ParallelState]:
    """Build or run a model as one whole rank inside a worker of a larger group (a speculative
    draft model beside a tensor-parallel target): no shards, no collectives."""
    global _state
    saved, _state = _state, ParallelState()
    try:
        yield _state
    finally:
        _state = saved


def destroy_model_parallel() -> None:
    """Leave the world, so that another engine in this process can start afresh."""
    global _state
    if dist.is_initialized():
        dist.destroy_process_group()
    _state = ParallelState()
