"""The LoRA adapters of one LLMServer replica behind the separate ingress, kept under Ray Serve's
model multiplexing: a request's adapter name is its multiplexed model id, Serve loads the adapter on
the replica on first use (`ReplicaAdapters.local`), keeps at most `max_num_adapters_per_replica`
of them, evicting the least recently used, and reports to the routers which adapters each replica
holds (`cluster.serve.routing` sends a request to a replica holding its adapter).

Adapter ids are the replica's own: the ingress (one of possibly several, each numbering its
adapters) sends the adapter's name and folder, and the replica numbers what its engine loads.
"""

from __future__ import annotations

import itertools
import logging

from ray import serve

from engine.frontend.async_llm_engine import AsyncLLMEngine
from engine.lora.request import LoRARequest

logger = logging.getLogger(__name__)


class _LoadedAdapter:
    """An adapter the replica's engine holds, as Serve's multiplexing keeps it.

    Serve awaits an evicted model's `__del__` attribute; it is set on the instance, so that garbage
    collection (which looks it up on the class) never calls it.
    """

    def __init__(self, adapters: ReplicaAdapters, request: LoRARequest) -> None:
        self.request = request
        self._adapters = adapters
        self.__del__ = self._unload

    async def _unload(self) -> None:
        logger.info("evicting LoRA adapter %r, this replica's least recently used", self.request.lora_name)
        await self._adapters.remove(self.request)


class ReplicaAdapters:
    """The adapters of one replica's engine, at most `max_adapters` of them."""

    def __init__(self, engine: AsyncLLMEngine, max_adapters: int) -> None:
        self._engine = engine
        self._ids = itertools.count(1)
        # The latest request for each adapter name: the folder Serve's loader (given only the name) loads.
        self._asked: dict[str, LoRARequest] = {}
        self._names: dict[int, str] = {}  # the engine's adapter ids -> their names

        async def load(name: str) -> _LoadedAdapter:
            return _LoadedAdapter(self, await self._add(self._asked[name]))

        # Wrapped here, not as a method: the count is the deployment's setting.
        self._load = serve.multiplexed(max_num_models_per_replica=max_adapters)(load)

    async def local(self, lora: LoRARequest) -> LoRARequest:
        """This replica's own request for the adapter `lora` names, loaded first when the replica
        does not hold it; ValueError (from the engine) for a bad adapter."""
        self._asked[lora.lora_name] = lora
        loaded: _LoadedAdapter = await self._load(lora.lora_name)
        if loaded.request.lora_path != lora.lora_path:
            # The name was unloaded at the ingress and loaded again from another folder.
            replaced = loaded.request
            loaded.request = await self._add(lora)
            await self.remove(replaced)
        return loaded.request

    async def names(self) -> list[str]:
        """The names of the adapters the engine holds."""
        if not self._names:  # nothing loaded here (or LoRA off): no need to ask the engine
            return []
        return [self._names[lora_id] for lora_id in await self._engine.list_loras() if lora_id in self._names]

    async def _add(self, lora: LoRARequest) -> LoRARequest:
        local = LoRARequest(lora.lora_name, next(self._ids), lora.lora_path, lora.base_model_name)
        await self._engine.add_lora(local)
        self._names[local.lora_int_id] = local.lora_name
        return local

    async def remove(self, lora: LoRARequest) -> None:
        """Drop an adapter this replica loaded from its engine."""
        self._names.pop(lora.lora_int_id, None)
        await self._engine.remove_lora(lora.lora_int_id)
