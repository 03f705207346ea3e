"""`LoRARequest`: which adapter a request runs with (vLLM's name and fields)."""

from __future__ import annotations

import msgspec


class LoRARequest(msgspec.Struct, frozen=True, array_like=True, omit_defaults=True):
    """A LoRA adapter by name, id and PEFT folder: `LoRARequest("sql", 1, "/adapters/sql")`.

    `lora_int_id` (a positive integer) is what the engine keys adapters by: two requests with the
    same id run the same adapter, and must give the same path.
    """

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not self.lora_name:
            raise ValueError("lora_name must be a non-empty string")
        if self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be a positive integer, got {self.lora_int_id}")
        if not self.lora_path:
            raise ValueError(f"LoRA adapter {self.lora_name!r}: lora_path must name its PEFT folder")


def prefix_cache_salt(cache_salt: str | None, lora_request: LoRARequest | None) -> str | None:
    """The salt of a request's first KV block: its own cache salt, and its adapter's name (as vLLM
    keys the blocks), so that no request reuses KV computed under another adapter (or none).

    The name, not the id: ids are per server, and KV-aware routing hashes prompts the same way on
    every replica."""
    if lora_request is None:
        return cache_salt
    return f"{cache_salt or ''}\x00lora:{lora_request.lora_name}"
