"""The forward context: what attention layers read during one forward pass, besides their inputs.

The model runner wraps each forward pass in `set_forward_context(metadata, kv_caches, backend)`;
every attention layer then calls `get_forward_context()` to find the batch layout, its own layer's
KV cache (by layer index) and the attention backend, and a projection with LoRA adapters finds which
rows run which adapter. This keeps model code as
`forward(input_ids, positions)` and is the only process-wide mutable state in the engine: it is set
for exactly the duration of one forward pass and cleared afterwards, per thread (with async
scheduling an in-process worker runs on a thread of its own, beside any other engine's forward
passes in the same process).
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
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


class _State(threading.local):
    current: ForwardContext | None = None


_state = _State()


def get_forward_context() -> ForwardContext:
    current = _state.current
    if current is None:
        raise RuntimeError("attention ran outside set_forward_context(): no batch metadata is set")
    return current


@contextlib.contextmanager
def set_forward_context(
    attn_metadata: AttentionMetadata,
    kv_caches: dict[int, torch.Tensor],
    attention_backend: AttentionBackend,
    lora_batch: LoRABatch | None = None,
) -> Iterator[ForwardContext]:
    previous = _state.current
    _state.current = ForwardContext(attn_metadata, kv_caches, attention_backend, lora_batch)
    try:
        yield _state.current
    finally:
        _state.current = previous
