"""Random LoRA adapters written as PEFT folders for a tiny Llama, and their independent reference: the
base model in transformers with each adapter merged into its weights by hand (W + scaling * B A)."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, PreTrainedModel

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
ALL_PROJECTIONS = ATTENTION + MLP


def projection_shapes(base: Path) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each projection of the Llama checkpoint at `base`."""
    config = json.loads((base / "config.json").read_text())
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    q_out = config["num_attention_heads"] * head_dim
    kv_out = config["num_key_value_heads"] * head_dim
    return {
        "q_proj": (hidden, q_out),
        "k_proj": (hidden, kv_out),
        "v_proj": (hidden, kv_out),
        "o_proj": (q_out, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }


def _module_path(layer: int, projection: str) -> str:
    block = "self_attn" if projection in ATTENTION else "mlp"
    return f"model.layers.{layer}.{block}.{projection}"


def write_peft_adapter(folder: Path, base: Path, **options: Any) -> Path:
    """A PEFT LoRA folder for the checkpoint at `base` (`write_adapter_files`' options: rank,
    alpha, targets, use_rslora, seed, std)."""
    config = json.loads((base / "config.json").read_text())
    return write_adapter_files(
        folder, projection_shapes(base), config["num_hidden_layers"], str(base), **options
    )


def write_adapter_files(
    folder: Path,
    shapes: dict[str, tuple[int, int]],
    num_layers: int,
    base_name: str,
    *,
    rank: int = 8,
    alpha: float = 16.0,
    targets: Sequence[str] = ALL_PROJECTIONS,
    use_rslora: bool = False,
    seed: int = 0,
    std: float = 0.1,
) -> Path:
    """A PEFT LoRA folder for a Llama of `num_layers` layers whose projections have `shapes`
    ((in_features, out_features) by name), with random A and B (PEFT's own init leaves B zero: an
    adapter that changes nothing) on every layer's `targets`."""
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(num_layers):
        for projection in targets:
            in_features, out_features = shapes[projection]
            prefix = f"base_model.model.{_module_path(layer, projection)}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, in_features, generator=generator) * std
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out_features, rank, generator=generator) * std
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, folder / "adapter_model.safetensors")
    adapter_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_name,
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": 0.0,
        "target_modules": list(targets),
        "use_rslora": use_rslora,
        "fan_in_fan_out": False,
        "bias": "none",
        "modules_to_save": None,
    }
    (folder / "adapter_config.json").write_text(json.dumps(adapter_config))
    return folder


def merged_reference(base: Path, adapter: Path | None) -> PreTrainedModel:
    """The base model in float32 transformers, with `adapter` (if any) merged by hand:
    W += scaling * B @ A, scaling = lora_alpha / r (lora_alpha / sqrt(r) under rsLoRA)."""
    model = AutoModelForCausalLM.from_pretrained(base, torch_dtype=torch.float32).eval()
    if adapter is None:
        return model
    adapter_config = json.loads((adapter / "adapter_config.json").read_text())
    rank = adapter_config["r"]
    divisor = math.sqrt(rank) if adapter_config.get("use_rslora") else rank
    scaling = adapter_config["lora_alpha"] / divisor
    from safetensors.torch import load_file

    tensors = load_file(adapter / "adapter_model.safetensors")
    modules = dict(model.named_modules())
    with torch.no_grad():
        for name, lora_a in tensors.items():
            if not name.endswith(".lora_A.weight"):
                continue
            path = name.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
            lora_b = tensors[name.replace(".lora_A.", ".lora_B.")]
            modules[path].weight += scaling * (lora_b.double() @ lora_a.double()).float()
    return model
