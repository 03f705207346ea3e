"""Which model class runs which checkpoint architecture."""

from __future__ import annotations

from torch import nn

from engine.models.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM
from engine.models.llama import LlamaForCausalLM
from engine.models.mixtral import MixtralForCausalLM
from engine.models.phi3 import Phi3ForCausalLM
from engine.models.qwen2_moe import Qwen2MoeForCausalLM
from engine.models.qwen3 import Qwen3ForCausalLM
from engine.models.qwen3_moe import Qwen3MoeForCausalLM

_MODELS: dict[str, type[nn.Module]] = {
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def get_model_class(architecture: str, where: object) -> type[nn.Module]:
    if architecture not in _MODELS:
        raise ValueError(
            f"model {where}: architecture {architecture!r} is not supported; supported: {', '.join(sorted(_MODELS))}"
        )
    return _MODELS[architecture]
