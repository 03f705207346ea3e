"""What the HTTP layer needs from an engine, so that the app does not depend on how it is hosted
(`AsyncLLMEngine` in this process, or a Ray Serve deployment holding one)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Protocol

from transformers import PreTrainedTokenizerBase

from engine.config import ResolvedEngineConfig
from engine.frontend.input_processor import InputProcessor, PromptType
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams


class EngineClient(Protocol):
    """The async engine interface of `engine.frontend.async_llm_engine.AsyncLLMEngine`."""

    config: ResolvedEngineConfig
    tokenizer: PreTrainedTokenizerBase
    input_processor: InputProcessor

    def generate(
        self, prompt: PromptType, sampling_params: SamplingParams, request_id: str, priority: int = 0
    ) -> AsyncIterator[RequestOutput]:
        """Outputs of one request; invalid input raises ValueError on the first step, and closing
        the iterator early aborts the request."""
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
