"""What the HTTP layer needs from an engine, so that the app does not depend on how it is hosted
(`AsyncLLMEngine` in this process, or a Ray Serve deployment holding one)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Protocol

from transformers import PreTrainedTokenizerBase

from engine.config import ResolvedEngineConfig
from engine.frontend.input_processor import InputProcessor, PromptType
from engine.lora.request import LoRARequest
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams


class EngineClient(Protocol):
    """The async engine interface of `engine.frontend.async_llm_engine.AsyncLLMEngine`."""

    config: ResolvedEngineConfig
    tokenizer: PreTrainedTokenizerBase
    input_processor: InputProcessor

    def generate(
        self,
        prompt: PromptType,
        sampling_params: SamplingParams,
        request_id: str,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Outputs of one request (with the adapter `lora_request`, if any); invalid input (a bad
        adapter too) raises ValueError on the first step, and closing the iterator early aborts the
        request."""
        ...

    async def add_lora(self, lora_request: LoRARequest) -> bool:
        """Check and load an adapter; ValueError naming the adapter and the field when it is bad."""
        ...

    async def remove_lora(self, lora_int_id: int) -> bool:
        """Drop a loaded adapter; False when none has that id."""
        ...

    async def list_loras(self) -> list[int]:
        """The ids of the adapters the engine holds loaded."""
        ...

    async def check_health(self) -> None:
        """Raises EngineDeadError when the engine cannot serve."""
        ...

    async def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; False (nothing changed) while a request holds KV blocks."""
        ...

    @property
    def errored(self) -> bool: ...

    def get_stats(self) -> dict[str, Any]: ...
