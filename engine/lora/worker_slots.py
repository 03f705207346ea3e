"""A worker's LoRA adapters: slots on its projections, loaded from a host cache of adapters.

The scheduler decides which adapter each slot holds (engine/sched/lora_slots.py) and sends the
loads with the step; this class carries them out. Adapters read from disk stay in a host LRU
cache of `max_cpu_loras`, so that an adapter evicted from a slot and needed again is copied back
from memory, not read again.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict

import numpy as np
import torch
from torch import nn

from engine.config import LoRAConfig
from engine.lora.layers import LoRAProjection, ProjectionPart
from engine.lora.peft_files import check_adapter, read_adapter_tensors
from engine.lora.request import LoRARequest
from engine.models.arch_config import ArchConfig
from engine.models.decoder import Attention, DecoderLayer, GatedMLP
from kernels.lora import LoRABatch
from parallel.layers import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear

logger = logging.getLogger(__name__)

# An adapter in host memory: its scaling, and (A, B) of each projection by layer and name.
HostAdapter = tuple[float, dict[int, dict[str, tuple[torch.Tensor, torch.Tensor]]]]


class LoRAWorkerSlots:
    """The adapter slots of one worker's model, and its host cache of adapters."""

    def __init__(
        self, model: nn.Module, arch: ArchConfig, config: LoRAConfig, dtype: torch.dtype, device: torch.device
    ) -> None:
        self.arch = arch
        self.config = config
        self.max_loras = config.max_loras
        self.projections: dict[int, list[LoRAProjection]] = {}  # by layer index
        for module in model.modules():
            if isinstance(module, DecoderLayer):
                self._adapt(module, dtype, device)
        self.host_cache: OrderedDict[int, HostAdapter] = OrderedDict()
        self.slot_of: dict[int, int] = {}  # lora_int_id -> slot

    def _adapt(self, layer: DecoderLayer, dtype: torch.dtype, device: torch.device) -> None:
        attention, mlp = layer.self_attn, layer.mlp
        if not isinstance(attention, Attention):
            raise ValueError(
                f"LoRA adapters need Llama-style attention, the model has {type(attention).__name__}"
            )
        targets: list[tuple[nn.Module, tuple[str, ...]]] = [
            (attention.qkv_proj, ("q_proj", "k_proj", "v_proj")),
            (attention.o_proj, ("o_proj",)),
        ]
        if isinstance(mlp, GatedMLP):  # mixture-of-experts MLPs take no adapters (check_adapter refuses them)
            targets += [(mlp.gate_up_proj, ("gate_proj", "up_proj")), (mlp.down_proj, ("down_proj",))]
        hooks = []
        for projection, names in targets:
            hook = LoRAProjection(
                _parts(projection, names),
                _input_columns(projection),
                self.max_loras,
                self.config.max_lora_rank,
                dtype,
                device,
            )
            projection.lora = hook
            hooks.append(hook)
        self.projections[attention.attn.layer_index] = hooks

    # ---- adapters in host memory ---------------------------------------------------------------

    def add_lora(self, lora: LoRARequest) -> bool:
        """Read an adapter into the host cache (evicting the least recently used beyond
        max_cpu_loras); False if it was there already."""
        if lora.lora_int_id in self.host_cache:
            self.host_cache.move_to_end(lora.lora_int_id)
            return False
        start = time.perf_counter()
        shape = check_adapter(lora, self.arch, self.config.max_lora_rank)
        by_layer: dict[int, dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}
        for (layer, projection), pair in read_adapter_tensors(lora).items():
            by_layer.setdefault(layer, {})[projection] = pair
        self.host_cache[lora.lora_int_id] = (shape.scaling, by_layer)
        while len(self.host_cache) > self.config.host_cache_size:
            self.host_cache.popitem(last=False)
        logger.info("LoRA adapter %s read in %.3f s", lora.lora_name, time.perf_counter() - start)
        return True

    def remove_lora(self, lora_int_id: int) -> bool:
        """Drop an adapter from the host cache (a slot holding it keeps it until replaced)."""
        return self.host_cache.pop(lora_int_id, None) is not None

    def list_loras(self) -> list[int]:
        return list(self.host_cache)

    # ---- slots ---------------------------------------------------------------------------------

    def load_slots(self, loads: dict[int, LoRARequest]) -> None:
        """Put each adapter into the slot the scheduler gave it."""
        for slot, lora in loads.items():
            self.add_lora(lora)
            scaling, by_layer = self.host_cache[lora.lora_int_id]
            for layer, hooks in self.projections.items():
                for hook in hooks:
                    hook.load(slot, by_layer.get(layer, {}), scaling)
            self.slot_of = {lora_id: s for lora_id, s in self.slot_of.items() if s != slot}
            self.slot_of[lora.lora_int_id] = slot

    def batch(self, lora_ids: list[int], query_lens: np.ndarray, device: torch.device) -> LoRABatch:
        """The step's rows grouped by slot: the rows of sequence i (query_lens[i] of them) run the
        adapter lora_ids[i] (0: none)."""
        slots = np.array([self.slot_of[lora_id] if lora_id else -1 for lora_id in lora_ids], dtype=np.int64)
        return LoRABatch.from_token_slots(np.repeat(slots, query_lens), self.max_loras, device)


def _parts(projection: nn.Module, names: tuple[str, ...]) -> tuple[ProjectionPart, ...]:
    """Where each checkpoint projection of a layer sits in its local output, and which rows of the
    full projection this rank holds (the layer's own sharding: see parallel/layers.py)."""
    if isinstance(projection, QKVParallelLinear):
        rank = projection.tp_rank
        kv_rank = rank // projection.kv_replicas
        q, kv = projection.q_size, projection.kv_size
        return (
            ProjectionPart("q_proj", 0, q, rank * q),
            ProjectionPart("k_proj", q, kv, kv_rank * kv),
            ProjectionPart("v_proj", q + kv, kv, kv_rank * kv),
        )
    if isinstance(projection, MergedColumnParallelLinear):
        parts, offset = [], 0
        for name, size in zip(names, projection.output_sizes, strict=True):
            local = size // projection.tp_size
            parts.append(ProjectionPart(name, offset, local, projection.tp_rank * local))
            offset += local
        return tuple(parts)
    if isinstance(projection, RowParallelLinear):
        return (ProjectionPart(names[0], 0, projection.output_size, 0),)
    raise TypeError(f"no LoRA slots for {type(projection).__name__}")


def _input_columns(projection: nn.Module) -> tuple[int, int]:
    if isinstance(projection, RowParallelLinear):
        size = projection.input_size_per_partition
        return projection.tp_rank * size, (projection.tp_rank + 1) * size
    return 0, projection.input_size
