"""Which LoRA adapter each device slot holds: decided here, once, for every worker.

The workers hold `max_loras` adapter slots (engine/lora/worker_slots.py). The scheduler admits a
request only while the running requests' distinct adapters fit the slots (`fits`), so a step never
needs more; `assign` then gives each of a step's adapters a slot, keeping the ones already loaded
and replacing the least recently used others, and returns the loads the workers make before the
step. Keeping the table here, rather than in each worker, means every tensor-parallel rank loads
the same adapter into the same slot without asking the others, and the core can count the loads
and evictions for the metrics.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from engine.lora.request import LoRARequest
from engine.outputs import LoRAStats


class LoRASlotTable:
    """Device slots -> the adapter each holds, in least-recently-used order."""

    def __init__(self, max_loras: int) -> None:
        self.max_loras = max_loras
        self._slot_of: OrderedDict[int, int] = OrderedDict()  # lora_int_id -> slot, LRU first
        self.num_loads = 0
        self.num_evictions = 0

    @staticmethod
    def fits(running: Iterable[LoRARequest | None], new: LoRARequest | None, max_loras: int) -> bool:
        """Whether adding a request with adapter `new` keeps the running adapters within the slots."""
        if new is None:
            return True
        ids = {lora.lora_int_id for lora in running if lora is not None}
        return new.lora_int_id in ids or len(ids) < max_loras

    def assign(self, adapters: Iterable[LoRARequest | None]) -> dict[int, LoRARequest]:
        """Slots for the running requests' adapters (at most max_loras distinct, as `fits` keeps
        them); the loads this takes, by slot. An adapter no running request uses is evicted first."""
        step = {lora.lora_int_id: lora for lora in adapters if lora is not None}
        if len(step) > self.max_loras:
            raise RuntimeError(
                f"the running requests use {len(step)} LoRA adapters, more than max_loras ({self.max_loras})"
            )
        for lora_id in step:
            if lora_id in self._slot_of:
                self._slot_of.move_to_end(lora_id)
        loads: dict[int, LoRARequest] = {}
        free = sorted(set(range(self.max_loras)) - set(self._slot_of.values()))
        for lora_id, lora in step.items():
            if lora_id in self._slot_of:
                continue
            if free:
                slot = free.pop(0)
            else:  # the least recently used adapter no running request uses
                victim = next(other for other in self._slot_of if other not in step)
                slot = self._slot_of.pop(victim)
                self.num_evictions += 1
            self._slot_of[lora_id] = slot
            loads[slot] = lora
            self.num_loads += 1
        return loads

    def forget(self, lora_int_id: int) -> None:
        """An adapter removed from the engine: its slot is free, and the id loads afresh if it
        comes back (maybe from another folder)."""
        self._slot_of.pop(lora_int_id, None)

    def stats(
        self, running: Iterable[LoRARequest | None], waiting: Iterable[LoRARequest | None]
    ) -> LoRAStats:
        return LoRAStats(
            running=_count_by_name(running),
            waiting=_count_by_name(waiting),
            max_loras=self.max_loras,
            num_loads=self.num_loads,
            num_evictions=self.num_evictions,
        )


def _count_by_name(adapters: Iterable[LoRARequest | None]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for lora in adapters:
        if lora is not None:
            counts[lora.lora_name] = counts.get(lora.lora_name, 0) + 1
    return counts
