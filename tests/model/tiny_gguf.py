"""A tiny Hugging Face checkpoint converted to GGUF the way llama.cpp's converter names and stores
it, with gguf-py's own tensor-name map (not the engine's) and SmolLM2's tokenizer copied from the
packaged GGUF, so that transformers' GGUF reader can serve as the independent reference."""

from __future__ import annotations

from pathlib import Path

import gguf
import torch
from safetensors.torch import load_file

from engine.models.model_files import packaged_model_path

_GGUF_ARCHITECTURES = {
    "Qwen3ForCausalLM": gguf.MODEL_ARCH.QWEN3,
    "Phi3ForCausalLM": gguf.MODEL_ARCH.PHI3,
    "Gemma2ForCausalLM": gguf.MODEL_ARCH.GEMMA2,
    "Gemma3ForCausalLM": gguf.MODEL_ARCH.GEMMA3,
}


def _copy_tokenizer(writer: gguf.GGUFWriter) -> None:
    reader = gguf.GGUFReader(packaged_model_path())
    for name, field in reader.fields.items():
        if not name.startswith("tokenizer."):
            continue
        value_type = field.types[0]
        sub_type = field.types[-1] if value_type == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), value_type, sub_type)


def write_gguf(folder: Path, config: dict, target: Path) -> Path:
    """`folder`'s safetensors (described by its config.json `config`) as a float32 GGUF at `target`."""
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
    _copy_tokenizer(writer)
    names = gguf.get_tensor_name_map(arch, num_layers)
    gemma = architecture.startswith("Gemma")
    for hf_name, tensor in load_file(folder / "model.safetensors").items():
        gguf_name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if gguf_name is None:
            raise ValueError(f"gguf-py has no name for {hf_name}")
        if gemma and hf_name.endswith("norm.weight"):
            tensor = tensor + 1.0  # llama.cpp's converter stores Gemma's norms as 1 + weight
        writer.add_tensor(gguf_name, tensor.to(torch.float32).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return target
