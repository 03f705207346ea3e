"""PEFT LoRA folders (adapter_config.json + adapter_model.safetensors), checked against the base model.

Checking reads only the config and the safetensors header, so the front end can refuse a bad
adapter (naming it and the field) before a request is queued; loading reads the tensors and folds
the adapter's scaling into B: lora_alpha / r, or lora_alpha / sqrt(r) under rsLoRA.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.lora.request import LoRARequest
from engine.models.arch_config import ArchConfig

ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight
_TENSOR_NAME = re.compile(
    r"base_model\.model\.model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.default)?\.weight"
)


@dataclass(frozen=True)
class AdapterShape:
    """What a checked adapter is: its rank, scaling, and the projections it adapts."""

    rank: int
    scaling: float
    projections: frozenset[tuple[int, str]]  # (layer, projection name)


def adapter_error(lora: LoRARequest, message: str) -> ValueError:
    """The error of an adapter that cannot run on this model, naming the adapter and the field at
    fault (a plain ValueError: it crosses processes and Ray by pickle as it is)."""
    return ValueError(f"LoRA adapter {lora.lora_name!r} ({lora.lora_path}): {message}")


def supported_projections(arch: ArchConfig) -> tuple[str, ...]:
    """The projections an adapter may target on this model: the MLP's only where it is dense."""
    return ATTENTION_PROJECTIONS + (() if arch.num_experts else MLP_PROJECTIONS)


def projection_shape(arch: ArchConfig, projection: str) -> tuple[int, int]:
    """(in_features, out_features) of one projection of the base model, unsharded."""
    q_out, kv_out = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    shapes = {
        "q_proj": (arch.hidden_size, q_out),
        "k_proj": (arch.hidden_size, kv_out),
        "v_proj": (arch.hidden_size, kv_out),
        "o_proj": (q_out, arch.hidden_size),
        "gate_proj": (arch.hidden_size, arch.intermediate_size),
        "up_proj": (arch.hidden_size, arch.intermediate_size),
        "down_proj": (arch.intermediate_size, arch.hidden_size),
    }
    return shapes[projection]


def check_adapter(lora: LoRARequest, arch: ArchConfig, max_lora_rank: int) -> AdapterShape:
    """The adapter's shape, or a ValueError (`adapter_error`): a missing folder or file, a rank above
    `max_lora_rank`, options raypage does not run (DoRA, biases, modules_to_save, fan_in_fan_out),
    target modules the model does not have, or tensors whose shapes do not match the base."""
    folder = Path(lora.lora_path)
    config = _read_config(lora, folder)
    rank = config.get("r")
    if not isinstance(rank, int) or rank < 1:
        raise adapter_error(lora, f"r must be a positive integer, got {rank!r}")
    if rank > max_lora_rank:
        raise adapter_error(lora, f"r ({rank}) is above max_lora_rank ({max_lora_rank})")
    _check_options(lora, config, arch)
    supported = supported_projections(arch)
    names = _tensor_shapes(lora, folder)
    projections: dict[tuple[int, str], set[str]] = {}
    for name, shape in names.items():
        match = _TENSOR_NAME.fullmatch(name)
        if match is None:
            raise adapter_error(
                lora,
                f"tensor {name!r} is not a LoRA A or B of a decoder layer's projection ({', '.join(supported)})",
            )
        layer, projection, part = int(match[1]), match[2], match[3]
        if projection not in supported:
            raise adapter_error(
                lora,
                f"target module {projection!r} is not supported on this model; supported: {', '.join(supported)}",
            )
        if layer >= arch.num_layers:
            raise adapter_error(lora, f"tensor {name!r}: the model has {arch.num_layers} layers")
        in_features, out_features = projection_shape(arch, projection)
        expected = (rank, in_features) if part == "A" else (out_features, rank)
        if tuple(shape) != expected:
            raise adapter_error(
                lora,
                f"tensor {name!r} has shape {tuple(shape)}, the base model's {projection} needs {expected}",
            )
        projections.setdefault((layer, projection), set()).add(part)
    for (layer, projection), parts in projections.items():
        if parts != {"A", "B"}:
            raise adapter_error(lora, f"layer {layer} {projection} has lora_{parts.pop()} without its pair")
    if not projections:
        raise adapter_error(lora, f"{WEIGHTS_FILE} holds no LoRA tensors")
    divisor = math.sqrt(rank) if config.get("use_rslora") else rank
    alpha = config.get("lora_alpha", rank)
    return AdapterShape(rank, float(alpha) / divisor, frozenset(projections))


def read_adapter_tensors(lora: LoRARequest) -> dict[tuple[int, str], tuple[Any, Any]]:
    """(A [r, in], B [out, r]) float32 tensors of each (layer, projection) the adapter adapts (the
    folder checked first by `check_adapter`)."""
    from safetensors.torch import load_file

    tensors = load_file(Path(lora.lora_path) / WEIGHTS_FILE)
    pairs: dict[tuple[int, str], dict[str, Any]] = {}
    for name, tensor in tensors.items():
        match = _TENSOR_NAME.fullmatch(name)
        pairs.setdefault((int(match[1]), match[2]), {})[match[3]] = tensor.float()
    return {key: (parts["A"], parts["B"]) for key, parts in pairs.items()}


def _read_config(lora: LoRARequest, folder: Path) -> dict[str, Any]:
    if not folder.is_dir():
        raise adapter_error(lora, "lora_path is not a folder")
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        if not (folder / name).is_file():
            raise adapter_error(lora, f"lora_path has no {name}")
    try:
        config = json.loads((folder / CONFIG_FILE).read_text())
    except (OSError, ValueError) as exc:
        raise adapter_error(lora, f"{CONFIG_FILE} cannot be read: {exc}") from None
    if not isinstance(config, dict):
        raise adapter_error(lora, f"{CONFIG_FILE} must hold a JSON object")
    return config


def _check_options(lora: LoRARequest, config: dict[str, Any], arch: ArchConfig) -> None:
    """Refuse the PEFT options that would change the math beyond W + scaling * B A."""
    if config.get("peft_type", "LORA") != "LORA":
        raise adapter_error(lora, f"peft_type {config['peft_type']!r} is not LORA")
    if config.get("use_dora"):
        raise adapter_error(lora, "use_dora (DoRA) is not supported")
    if config.get("bias", "none") != "none":
        raise adapter_error(lora, f"bias {config['bias']!r} is not supported (only 'none')")
    if config.get("fan_in_fan_out"):
        raise adapter_error(lora, "fan_in_fan_out is not supported (Llama's projections are not Conv1D)")
    if config.get("modules_to_save"):
        raise adapter_error(
            lora, f"modules_to_save {config['modules_to_save']} is not supported (whole trained modules)"
        )
    targets = config.get("target_modules")
    if isinstance(targets, list):
        supported = supported_projections(arch)
        for target in targets:
            if target not in supported:
                embedding = " (the embedding and LM head, tied or not, stay the base model's)"
                hint = embedding if target in ("embed_tokens", "lm_head") else ""
                raise adapter_error(
                    lora,
                    f"target_modules has {target!r}, which this model does not have as an adaptable "
                    f"projection{hint}; supported: {', '.join(supported)}",
                )


def _tensor_shapes(lora: LoRARequest, folder: Path) -> dict[str, list[int]]:
    """The shapes of the safetensors file's tensors, from its header alone."""
    from safetensors import safe_open

    try:
        with safe_open(str(folder / WEIGHTS_FILE), framework="pt") as weights:
            return {name: list(weights.get_slice(name).get_shape()) for name in weights.keys()}  # noqa: SIM118
    except Exception as exc:  # safetensors raises its own error types for a damaged file
        raise adapter_error(lora, f"{WEIGHTS_FILE} cannot be read: {exc}") from None
