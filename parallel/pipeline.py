"""Pipeline parallelism: which layers each stage holds, and the tensors stages pass along.

Stage s runs layers [start_s, end_s); the first stage also embeds tokens, the last also applies the
final norm, the LM head and sampling. Between stages travel the hidden states and the residual
stream (IntermediateTensors), sent with torch.distributed point-to-point from each TP rank to the
same TP rank of the next stage (hidden states are identical across a TP group after its
all-reduce, so nothing needs gathering).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from parallel.comm import timed
from parallel.state import get_parallel_state


def partition_layers(
    num_layers: int, pp_size: int, partition: list[int] | None = None
) -> list[tuple[int, int]]:
    """[start, end) layer ranges of every stage: `partition` layer counts, or an even split that
    gives any remainder to the first stages (the last one also runs the LM head and sampling)."""
    if partition is None:
        base, extra = divmod(num_layers, pp_size)
        partition = [base + (1 if stage < extra else 0) for stage in range(pp_size)]
    if len(partition) != pp_size:
        raise ValueError(
            f"pipeline_partition has {len(partition)} entries, but pipeline_parallel_size is {pp_size}"
        )
    if sum(partition) != num_layers or min(partition) < 1:
        raise ValueError(
            f"pipeline_partition {partition} must give every stage at least one layer and sum to the "
            f"model's {num_layers} layers"
        )
    starts = [sum(partition[:stage]) for stage in range(pp_size)]
    return [(start, start + count) for start, count in zip(starts, partition, strict=True)]


def stage_layers(num_layers: int, partition: list[int] | None = None) -> tuple[int, int]:
    """The [start, end) layer range of this process's stage."""
    state = get_parallel_state()
    return partition_layers(num_layers, state.pp_size, partition)[state.pp_rank]


@dataclasses.dataclass
class IntermediateTensors:
    """What one stage hands the next: the hidden states and the residual stream, [tokens, hidden]."""

    hidden_states: torch.Tensor
    residual: torch.Tensor


def send_to_next_stage(tensors: IntermediateTensors) -> None:
    state = get_parallel_state()
    destination = (state.pp_rank + 1) * state.tp_size + state.tp_rank
    with timed("send"):
        for tensor in (tensors.hidden_states, tensors.residual):
            dist.send(tensor.contiguous(), dst=destination)


def receive_from_previous_stage(
    num_tokens: int, hidden_size: int, dtype: torch.dtype, device: torch.device
) -> IntermediateTensors:
    state = get_parallel_state()
    source = (state.pp_rank - 1) * state.tp_size + state.tp_rank
    received = [torch.empty(num_tokens, hidden_size, dtype=dtype, device=device) for _ in range(2)]
    with timed("recv"):
        for tensor in received:
            dist.recv(tensor, src=source)
    return IntermediateTensors(*received)
