"""raypage's engine: requests -> scheduler -> executor -> workers -> outputs.

The offline API keeps vLLM's names: `from engine import LLM, SamplingParams`.
"""

from engine.config import EngineConfig
from engine.llm import LLM
from engine.llm_engine import LLMEngine
from engine.outputs import CompletionOutput, RequestOutput
from engine.sampling_params import SamplingParams

__all__ = ["LLM", "CompletionOutput", "EngineConfig", "LLMEngine", "RequestOutput", "SamplingParams"]
