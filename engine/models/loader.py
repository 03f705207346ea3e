"""Builds a model for this rank and streams its checkpoint in, one tensor at a time."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from engine.models.arch_config import ArchConfig
from engine.models.model_files import ModelSource
from engine.models.quantized_weights import quantize_to_int8
from engine.models.registry import get_model_class
from kernels.build import cpu_kernels_available
from parallel.layers import prepare_linear_weights

logger = logging.getLogger(__name__)


def safetensors_files(folder: Path) -> list[Path]:
    """The shards named by model.safetensors.index.json, or every *.safetensors file."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [folder / name for name in names]
    return sorted(folder.glob("*.safetensors"))


def iterate_safetensors_weights(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    for file in safetensors_files(folder):
        with safe_open(file, framework="pt") as reader:
            for name in reader.keys():  # noqa: SIM118 (safe_open is not a mapping)
                yield name, reader.get_tensor(name)


def iterate_weights(source: ModelSource, quantization: str | None = "none") -> Iterator[tuple[str, Any]]:
    """The checkpoint's tensors by Hugging Face name; a GGUF file's projections in their blocks
    unless `quantization` is "none" (engine/models/gguf_loader.py), and with "int8" every float
    projection quantized into int8 blocks (engine/models/quantized_weights.py)."""
    if source.format == "gguf":
        from engine.models.gguf_loader import iterate_gguf_weights

        weights = iterate_gguf_weights(source.path, quantization)
    else:
        weights = iterate_safetensors_weights(source.path)
    return quantize_to_int8(weights) if quantization == "int8" else weights


def weight_quantization(quantization: str | None, device: torch.device, dtype: torch.dtype) -> str | None:
    """`quantization` where the quantized kernels run (bf16 activations on the CPU, compiled
    kernels), else "none": GGUF blocks are then dequantized at load. float32 runs (the parity
    settings) compute with the file's exact values; "int8", and "strict" anywhere but float32, is an
    error elsewhere."""
    if device.type == "cpu" and dtype == torch.bfloat16 and cpu_kernels_available():
        return quantization
    if quantization == "int8" or (quantization == "strict" and dtype != torch.float32):
        raise ValueError(
            f"quantization {quantization}: the quantized kernels take bfloat16 activations on the CPU "
            f"with raypage's compiled kernels, not {dtype} on {device.type}"
        )
    return "none"


def load_model(
    source: ModelSource,
    arch: ArchConfig,
    dtype: torch.dtype,
    device: torch.device,
    pipeline_partition: list[int] | None = None,
    quantization: str | None = "none",
) -> nn.Module:
    """Instantiate this rank's shard of the model in `dtype` on `device` and fill it from the
    checkpoint; GGUF projections stay in their blocks unless `quantization` is "none"."""
    model_class = get_model_class(arch.architecture, source.path)
    with torch.device(device):
        model = model_class(arch, dtype, pipeline_partition)
    model.load_weights(iterate_weights(source, weight_quantization(quantization, device, dtype)))
    prepare_linear_weights(model)
    logger.info("loaded %s (%s, %s) from %s", arch.architecture, dtype, device, source.path)
    return model.eval()
