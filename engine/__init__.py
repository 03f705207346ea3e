"""raypage's engine: requests -> scheduler -> executor -> workers -> outputs.

The offline API keeps vLLM's names: `from engine import LLM, SamplingParams`.
"""

from engine.config import EngineConfig
from engine.llm import LLM
from engine.llm_engine import LLMEngine
from engine.logprobs import Logprob
from engine.outputs import BeamSearchOutput, BeamSearchSequence, CompletionOutput, RequestOutput
from engine.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams

__all__ = [
    "LLM",
    "BeamSearchOutput",
    "BeamSearchParams",
    "BeamSearchSequence",
    "CompletionOutput",
    "EngineConfig",
    "LLMEngine",
    "Logprob",
    "RequestOutput",
    "RequestOutputKind",
    "SamplingParams",
]
