"""The bodies of vLLM's runtime LoRA routes, POST /v1/load_lora_adapter and /v1/unload_lora_adapter."""

from __future__ import annotations

from pydantic import Field

from cluster.openai.protocol import OpenAIBaseModel


class LoadLoRAAdapterRequest(OpenAIBaseModel):
    """Serve the PEFT folder `lora_path` under the name `lora_name`."""

    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadLoRAAdapterRequest(OpenAIBaseModel):
    """Stop serving the adapter `lora_name`."""

    lora_name: str = Field(min_length=1)
