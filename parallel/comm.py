"""Collectives over the tensor-parallel group; each is a no-op at group size 1."""

from __future__ import annotations

import torch
import torch.distributed as dist

from parallel.state import get_parallel_state


def tensor_parallel_all_reduce(tensor: torch.Tensor) -> torch.Tensor:
    """Sum a tensor over the TP group, in place."""
    state = get_parallel_state()
    if state.tp_size > 1:
        dist.all_reduce(tensor, group=state.tp_group)
    return tensor


def tensor_parallel_all_gather(tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate each rank's tensor along `dim`, in rank order."""
    state = get_parallel_state()
    if state.tp_size == 1:
        return tensor
    parts = [torch.empty_like(tensor) for _ in range(state.tp_size)]
    dist.all_gather(parts, tensor.contiguous(), group=state.tp_group)
    return torch.cat(parts, dim=dim)
