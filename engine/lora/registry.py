"""The front end's record of the adapters requests have named: each checked once, before queuing."""

from __future__ import annotations

from engine.config import LoRAConfig
from engine.lora.peft_files import check_adapter
from engine.lora.request import LoRARequest
from engine.models.arch_config import ArchConfig


class LoRARegistry:
    """Checks each request's LoRARequest: adapters enabled, the adapter runnable on this model
    (checked once per id), and one id, name and folder to each adapter."""

    def __init__(self, arch: ArchConfig, config: LoRAConfig) -> None:
        self.arch = arch
        self.config = config
        self._by_id: dict[int, LoRARequest] = {}
        self._id_of_name: dict[str, int] = {}

    def check(self, lora: LoRARequest) -> None:
        """Raise ValueError, naming the adapter and the field, unless `lora` can run here."""
        if not isinstance(lora, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got {type(lora).__name__}")
        if not self.config.enable_lora:
            raise ValueError(
                f"lora_request {lora.lora_name!r}: LoRA adapters are not enabled (start the engine with enable_lora=True)"
            )
        known = self._by_id.get(lora.lora_int_id)
        if known is not None:
            if (known.lora_name, known.lora_path) != (lora.lora_name, lora.lora_path):
                raise ValueError(
                    f"lora_int_id {lora.lora_int_id} is adapter {known.lora_name!r} ({known.lora_path}), "
                    f"not {lora.lora_name!r} ({lora.lora_path})"
                )
            return
        other = self._id_of_name.get(lora.lora_name)
        if other is not None:
            raise ValueError(
                f"lora_name {lora.lora_name!r} is already adapter id {other}, not {lora.lora_int_id}"
            )
        check_adapter(lora, self.arch, self.config.max_lora_rank)
        self._by_id[lora.lora_int_id] = lora
        self._id_of_name[lora.lora_name] = lora.lora_int_id

    def forget(self, lora_int_id: int) -> None:
        """An adapter removed: its id and name may name another one from now on."""
        lora = self._by_id.pop(lora_int_id, None)
        if lora is not None:
            self._id_of_name.pop(lora.lora_name, None)
