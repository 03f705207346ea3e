"""The forward context: what attention layers read during one forward pass, besides their inputs.

The model runner wraps each forward pass in `set_forward_context(metadata, kv_caches, backend)`;
every attention layer then calls `get_forward_context()` to find the batch layout, its own layer's
KV cache (by layer index) and the attention backend, and a projection with LoRA adapters finds which
rows run which adapter. This keeps model code as
`forward(input_ids, positions)` and is the only process-wide mutable state in the engine: it is set
for exactly the duration of one forward pass and cleared afterwards.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

import torch

from kernels.attention import AttentionBackend, AttentionMetadata
from kernels.lora import LoRABatch


@dataclasses.dataclass
class ForwardContext:
    """The current forward pass: batch layout, KV caches by global layer index, backend."""

    attn_metadata: AttentionMetadata
    kv_caches: dict[int, torch.Tensor]
    attention_backend: AttentionBackend
    # The step's rows grouped by LoRA adapter slot, read by the adapted projections (None: no adapters).
    lora_batch: LoRABatch | None = None


_current: ForwardContext | None = None


def get_forward_context() -> ForwardContext:
    if _current is None:
        raise RuntimeError("attention ran outside set_forward_context(): no batch metadata is set")
    return _current


@contextlib.contextmanager
def set_forward_context(
    attn_metadata: AttentionMetadata,
    kv_caches: dict[int, torch.Tensor],
    attention_backend: AttentionBackend,
    lora_batch: LoRABatch | None = None,
) -> Iterator[ForwardContext]:
    global _current
    previous = _current
    _current = ForwardContext(attn_metadata, kv_caches, attention_backend, lora_batch)
    try:
        yield _current
    finally:
        _current = previous
