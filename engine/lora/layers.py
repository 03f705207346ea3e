"""The adapter slots of one projection: stacked A and B tensors, and the hook its layer calls.

A projection (parallel/layers.py) with `lora` set calls it after its matmul with its input and
output; the hook adds the products of every adapter the step's rows run (`kernels.lora.add_lora`,
rows grouped by slot in the forward context). Under tensor parallelism each rank keeps its shard of
each adapter cut like the base weight: B's rows of a column-parallel projection's output, A's
columns of a row-parallel one's input (whose partial products the layer's all-reduce sums).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.forward_context import get_forward_context
from kernels.lora import add_lora


@dataclass(frozen=True)
class ProjectionPart:
    """One checkpoint projection inside a (maybe fused) layer, and this rank's shard of it: rows
    [row_start, row_start + rows) of the full output land at `offset` of the layer's local output."""

    name: str  # the checkpoint's projection name, e.g. "k_proj"
    offset: int
    rows: int
    row_start: int


class LoRAProjection:
    """The `max_loras` adapter slots of one projection layer (all its parts), called as `hook(x, out)`."""

    def __init__(
        self,
        parts: tuple[ProjectionPart, ...],
        input_columns: tuple[int, int],
        max_loras: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.parts = parts
        self.slice_sizes = tuple(part.rows for part in parts)
        # This rank's columns of the full input: all of them but on a row-parallel projection.
        self.input_columns = input_columns
        self.max_rank = max_rank
        in_features = input_columns[1] - input_columns[0]
        out_features = sum(self.slice_sizes)
        self.lora_a = torch.zeros(max_loras, len(parts) * max_rank, in_features, dtype=dtype, device=device)
        self.lora_b = torch.zeros(max_loras, out_features, max_rank, dtype=dtype, device=device)

    def __call__(self, x: torch.Tensor, out: torch.Tensor) -> None:
        batch = get_forward_context().lora_batch
        if batch is not None:  # (None: no row of the step runs an adapter)
            add_lora(out, x, self.lora_a, self.lora_b, self.slice_sizes, batch)

    def load(self, slot: int, adapter: dict[str, tuple[torch.Tensor, torch.Tensor]], scaling: float) -> None:
        """Put an adapter's (A [r, in], B [out, r]) of each part it adapts into `slot` (parts it
        leaves out stay zero), scaling folded into B, cut to this rank's shard."""
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        first, last = self.input_columns
        for index, part in enumerate(self.parts):
            if part.name not in adapter:
                continue
            lora_a, lora_b = adapter[part.name]
            rank = lora_a.shape[0]
            rows = slice(index * self.max_rank, index * self.max_rank + rank)
            self.lora_a[slot, rows].copy_(lora_a[:, first:last])
            shard = lora_b[part.row_start : part.row_start + part.rows]
            self.lora_b[slot, part.offset : part.offset + part.rows, :rank].copy_(shard * scaling)
