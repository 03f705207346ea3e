"""GGUF files: the header as an ArchConfig, the tensors dequantized under Hugging Face names.

llama.cpp's converter permutes the rows of Llama's Q and K projections to suit its rotary layout
(pairs of adjacent features instead of halves); loading undoes that so the weights match the
Hugging Face checkpoint the GGUF came from. Qwen2 is converted without the permutation.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import torch

from engine.models.arch_config import ArchConfig
from engine.models.gguf_file import GGUFFile

# GGUF architecture -> the Hugging Face architecture name our registry knows.
_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
_PERMUTED_ARCHITECTURES = {"llama", "mistral"}

_LAYER_TENSORS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def _architecture(gguf: GGUFFile) -> str:
    arch = gguf.get("general.architecture")
    if arch not in _ARCHITECTURES:
        raise ValueError(
            f"model {gguf.path}: GGUF architecture {arch!r} is not supported; supported: {', '.join(_ARCHITECTURES)}"
        )
    return arch


def read_gguf_arch_config(path: Path) -> ArchConfig:
    gguf = GGUFFile(path)
    arch = _architecture(gguf)
    get = gguf.get
    num_heads = get(f"{arch}.attention.head_count")
    hidden_size = get(f"{arch}.embedding_length")
    tensor_names = {tensor.name for tensor in gguf.tensors}
    scaling_type = get(f"{arch}.rope.scaling.type")
    rope_scaling = None
    if scaling_type not in (None, "none"):
        rope_scaling = {
            "rope_type": scaling_type,
            "factor": get(f"{arch}.rope.scaling.factor", 1.0),
            "original_max_position_embeddings": get(f"{arch}.rope.scaling.original_context_length"),
        }
    return ArchConfig(
        architecture=_ARCHITECTURES[arch],
        vocab_size=get(f"{arch}.vocab_size") or len(get("tokenizer.ggml.tokens", ())),
        hidden_size=hidden_size,
        intermediate_size=get(f"{arch}.feed_forward_length"),
        num_layers=get(f"{arch}.block_count"),
        num_heads=num_heads,
        num_kv_heads=get(f"{arch}.attention.head_count_kv", num_heads),
        head_dim=get(f"{arch}.attention.key_length", hidden_size // num_heads),
        rms_norm_eps=get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6),
        rope_theta=float(get(f"{arch}.rope.freq_base", 10000.0)),
        max_position_embeddings=get(f"{arch}.context_length", 2048),
        tie_word_embeddings="output.weight" not in tensor_names,
        qkv_bias="blk.0.attn_q.bias" in tensor_names,
        o_bias="blk.0.attn_output.bias" in tensor_names,
        rope_scaling=rope_scaling,
        eos_token_ids=tuple(token for token in [get("tokenizer.ggml.eos_token_id")] if token is not None),
    )


def _hf_name(gguf_name: str) -> str:
    match = _LAYER_NAME.fullmatch(gguf_name)
    if match:
        layer, kind, suffix = match.groups()
        if kind in _LAYER_TENSORS:
            return f"model.layers.{layer}.{_LAYER_TENSORS[kind]}.{suffix}"
    else:
        base, _, suffix = gguf_name.rpartition(".")
        if base in _GLOBAL_TENSORS:
            return f"{_GLOBAL_TENSORS[base]}.{suffix}"
    raise ValueError(f"GGUF tensor {gguf_name!r} has no place in a Llama-family model")


def unpermute_rotary_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Invert llama.cpp's per-head interleaving of Q/K rows (the inverse of its `permute`)."""
    half = weight.shape[0] // num_heads // 2
    return weight.reshape(num_heads, half, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def iterate_gguf_weights(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, float32 tensor) for every tensor in the file, dequantized one at a time."""
    gguf = GGUFFile(path)
    arch = _architecture(gguf)
    num_heads = gguf.get(f"{arch}.attention.head_count")
    num_kv_heads = gguf.get(f"{arch}.attention.head_count_kv", num_heads)
    for tensor in gguf.tensors:
        name = _hf_name(tensor.name)
        values = torch.from_numpy(gguf.dequantize(tensor))
        if arch in _PERMUTED_ARCHITECTURES and name.endswith(("q_proj.weight", "q_proj.bias")):
            values = unpermute_rotary_rows(values, num_heads)
        elif arch in _PERMUTED_ARCHITECTURES and name.endswith(("k_proj.weight", "k_proj.bias")):
            values = unpermute_rotary_rows(values, num_kv_heads)
        yield name, values
