"""raypage's engine: requests -> scheduler -> executor -> workers -> outputs.

The offline API keeps vLLM's names: `from engine import LLM, SamplingParams`.

The names are imported on first use (PEP 562), not with the package: every process that imports
any `engine.*` module imports this package first, and the front end's names pull in transformers
and the tokenizers, which an engine core process or a worker (spawned, or a Ray actor) never uses.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from engine.frontend.llm import LLM
    from engine.frontend.llm_engine import LLMEngine
    from engine.frontend.logprobs import Logprob
    from engine.lora.request import LoRARequest
    from engine.outputs import BeamSearchOutput, BeamSearchSequence, CompletionOutput, RequestOutput
    from engine.sampling_params import (
        BeamSearchParams,
        RequestOutputKind,
        SamplingParams,
        StructuredOutputsParams,
    )

# Each public name -> the module that defines it.
_EXPORTS = {
    "LLM": "engine.frontend.llm",
    "BeamSearchOutput": "engine.outputs",
    "BeamSearchParams": "engine.sampling_params",
    "BeamSearchSequence": "engine.outputs",
    "CompletionOutput": "engine.outputs",
    "EngineConfig": "engine.config",
    "LLMEngine": "engine.frontend.llm_engine",
    "Logprob": "engine.frontend.logprobs",
    "LoRARequest": "engine.lora.request",
    "RequestOutput": "engine.outputs",
    "RequestOutputKind": "engine.sampling_params",
    "SamplingParams": "engine.sampling_params",
    "StructuredOutputsParams": "engine.sampling_params",
}

__all__ = [
    "LLM",
    "BeamSearchOutput",
    "BeamSearchParams",
    "BeamSearchSequence",
    "CompletionOutput",
    "EngineConfig",
    "LLMEngine",
    "LoRARequest",
    "Logprob",
    "RequestOutput",
    "RequestOutputKind",
    "SamplingParams",
    "StructuredOutputsParams",
]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
