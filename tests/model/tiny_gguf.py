"""A tiny Hugging Face checkpoint converted to GGUF the way llama.cpp's converter names and stores
it, with gguf-py's own tensor-name map (not the engine's) and SmolLM2's tokenizer copied from the
packaged GGUF (or none), so that transformers' GGUF reader can serve as the independent reference.

Mixtures of experts are stacked a projection per layer (`ffn_gate_exps` [experts, intermediate,
hidden]) and Llama's (Mixtral's) Q and K rows permuted, as llama.cpp's converter writes them."""

from __future__ import annotations

import functools
import re
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from safetensors.torch import load_file

from engine.models.model_files import packaged_model_path

_GGUF_ARCHITECTURES = {
    "Qwen3ForCausalLM": gguf.MODEL_ARCH.QWEN3,
    "Phi3ForCausalLM": gguf.MODEL_ARCH.PHI3,
    "Gemma2ForCausalLM": gguf.MODEL_ARCH.GEMMA2,
    "Gemma3ForCausalLM": gguf.MODEL_ARCH.GEMMA3,
    "Qwen2MoeForCausalLM": gguf.MODEL_ARCH.QWEN2MOE,
    "Qwen3MoeForCausalLM": gguf.MODEL_ARCH.QWEN3MOE,
    "MixtralForCausalLM": gguf.MODEL_ARCH.LLAMA,
    "LlamaForCausalLM": gguf.MODEL_ARCH.LLAMA,
}
# One expert's projection, by Hub names (Qwen's and Mixtral's).
_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w2|w3)\.weight$")


def _llama_cpp_permute(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's converter's `permute` of Llama's Q and K rows to its rotary layout."""
    return (
        weights.reshape(num_heads, 2, weights.shape[0] // num_heads // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def _converted_tensors(folder: Path, config: dict) -> dict[str, np.ndarray]:
    """The checkpoint's tensors as float32 arrays under Hugging Face names, with each layer's experts
    stacked under `...experts.<projection>.weight` and Llama's Q/K rows permuted."""
    tensors: dict[str, np.ndarray] = {}
    experts: defaultdict[str, dict[int, np.ndarray]] = defaultdict(dict)
    llama = config["architectures"][0] in ("MixtralForCausalLM", "LlamaForCausalLM")
    for name, tensor in load_file(folder / "model.safetensors").items():
        values = tensor.to(torch.float32).numpy()
        if match := _EXPERT.match(name):
            module, expert, projection = match.groups()
            experts[f"{module}.{projection}.weight"][int(expert)] = values
            continue
        if llama and name.endswith("q_proj.weight"):
            values = _llama_cpp_permute(values, config["num_attention_heads"])
        elif llama and name.endswith("k_proj.weight"):
            values = _llama_cpp_permute(values, config["num_key_value_heads"])
        tensors[name] = values
    for name, by_expert in experts.items():
        tensors[name] = np.stack([by_expert[e] for e in sorted(by_expert)])
    return tensors


def _add_expert_settings(writer: gguf.GGUFWriter, config: dict) -> None:
    num_experts = config.get("num_local_experts") or config.get("num_experts")
    if not num_experts:
        return
    writer.add_expert_count(num_experts)
    writer.add_expert_used_count(config["num_experts_per_tok"])
    writer.add_expert_feed_forward_length(config.get("moe_intermediate_size") or config["intermediate_size"])
    if config.get("shared_expert_intermediate_size"):
        writer.add_expert_shared_feed_forward_length(config["shared_expert_intermediate_size"])


@functools.cache
def _packaged_tokenizer_fields() -> tuple[
    tuple[str, Any, gguf.GGUFValueType, gguf.GGUFValueType | None], ...
]:
    """The packaged SmolLM2's `tokenizer.*` keys as (name, value, type, element type), read once a
    session: gguf-py takes seconds to parse the 49,152 tokens and their merges."""
    reader = gguf.GGUFReader(packaged_model_path())
    fields = []
    for name, field in reader.fields.items():
        if not name.startswith("tokenizer."):
            continue
        value_type = field.types[0]
        sub_type = field.types[-1] if value_type == gguf.GGUFValueType.ARRAY else None
        fields.append((name, field.contents(), value_type, sub_type))
    return tuple(fields)


def copy_tokenizer(writer: gguf.GGUFWriter) -> None:
    """The packaged SmolLM2's tokenizer (every `tokenizer.*` key) into `writer`."""
    for name, value, value_type, sub_type in _packaged_tokenizer_fields():
        writer.add_key_value(name, value, value_type, sub_type)


def write_gguf(
    folder: Path,
    config: dict,
    target: Path,
    block_format: Callable[[str], gguf.GGMLQuantizationType | None] = lambda name: None,
    with_tokenizer: bool = True,
) -> Path:
    """`folder`'s safetensors (described by its config.json `config`) as a GGUF at `target`: float32,
    but for the tensors `block_format` names a block format for (by Hugging Face name), quantized
    with gguf-py as llama.cpp's quantizer stores them. Without the tokenizer (`with_tokenizer=False`)
    transformers' reader loads the file in a tenth of a second instead of seconds: it parses the
    49,152 tokens and their merges three times a `from_pretrained`."""
    architecture = config["architectures"][0]
    arch = _GGUF_ARCHITECTURES[architecture]
    name = gguf.MODEL_ARCH_NAMES[arch]
    num_layers = config["num_hidden_layers"]
    writer = gguf.GGUFWriter(target, name)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(num_layers)
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])
    if config.get("head_dim"):
        writer.add_key_length(config["head_dim"])
        writer.add_value_length(config["head_dim"])
    rope = config.get("rope_parameters") or {}
    rope = rope.get("full_attention", rope)
    writer.add_rope_freq_base(rope.get("rope_theta", 10000.0))
    if config.get("sliding_window"):
        writer.add_sliding_window(config["sliding_window"])
    if config.get("attn_logit_softcapping"):
        writer.add_attn_logit_softcapping(config["attn_logit_softcapping"])
        writer.add_final_logit_softcapping(config["final_logit_softcapping"])
    _add_expert_settings(writer, config)
    if with_tokenizer:
        copy_tokenizer(writer)
    names = gguf.get_tensor_name_map(arch, num_layers)
    gemma = architecture.startswith("Gemma")
    for hf_name, tensor in _converted_tensors(folder, config).items():
        gguf_name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if gguf_name is None:
            raise ValueError(f"gguf-py has no name for {hf_name}")
        if gemma and hf_name.endswith("norm.weight"):
            tensor = tensor + 1.0  # llama.cpp's converter stores Gemma's norms as 1 + weight
        if (qtype := block_format(hf_name)) is not None:
            writer.add_tensor(gguf_name, gguf.quants.quantize(tensor, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(gguf_name, tensor)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return target
