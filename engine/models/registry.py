"""Which model class runs which checkpoint architecture."""

from __future__ import annotations

from torch import nn

from engine.models.llama import LlamaForCausalLM

_MODELS: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
}


def get_model_class(architecture: str, where: object) -> type[nn.Module]:
    if architecture not in _MODELS:
        raise ValueError(
            f"model {where}: architecture {architecture!r} is not supported; supported: {', '.join(sorted(_MODELS))}"
        )
    return _MODELS[architecture]
