"""GGUF files: the header as an ArchConfig, the tensors dequantized under Hugging Face names.

llama.cpp's converter permutes the rows of Llama's Q and K projections to suit its rotary layout
(pairs of adjacent features instead of halves), and stores Gemma's norms as 1 + weight; loading
undoes both, so the weights match the Hugging Face checkpoint the GGUF came from. Qwen2/3, Phi-3 and
Gemma are converted without the permutation.

Mixtures of experts (`qwen2moe`, `qwen3moe`, and Mixtral as `llama` with an expert count) hold each
layer's experts stacked in one tensor a projection (`ffn_gate_exps` [experts, intermediate,
hidden], ...); they are read as the stacked `mlp.experts.gate_proj` etc., which the model splits.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType

from engine.models.arch_config import ArchConfig, layer_types_of
from engine.models.gguf_file import GGUFFile, GGUFTensorInfo
from engine.models.quantized_weights import KEPT_IN_BLOCKS
from kernels.gguf_blocks import GGUFBlocks
from kernels.quant_linear import supported_ggml_types

logger = logging.getLogger(__name__)

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
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}
_QK_NORMS = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
_GEMMA_NORMS = {
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_FLOAT_TYPES = (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16)
_LAYER_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


@dataclasses.dataclass(frozen=True)
class _GGUFArchitecture:
    """How llama.cpp's converter stored one architecture."""

    hf_architecture: str
    # Q and K rows interleaved per head for llama.cpp's rotary layout (Llama, Mistral).
    permuted: bool = False
    # Tensor names that differ from Llama's: llama.cpp name -> Hugging Face name inside a layer.
    layer_tensors: dict[str, str] = dataclasses.field(default_factory=dict)
    # Gemma's norms are stored as 1 + weight (the converter adds the one that Gemma's norm adds).
    norms_plus_one: bool = False
    # The architecture with experts where the file has an expert count (Mixtral is `llama`).
    moe_architecture: str | None = None
    # Whether the top-k routing weights are renormalized where the file does not say
    # (`expert_weights_norm`): what llama.cpp does for the architecture.
    norm_topk_prob: bool = True

    def hf_layer_tensor(self, kind: str) -> str | None:
        return self.layer_tensors.get(kind) or _LAYER_TENSORS.get(kind)


# GGUF architecture -> how to read it as the Hugging Face architecture our registry knows.
_ARCHITECTURES = {
    "llama": _GGUFArchitecture("LlamaForCausalLM", permuted=True, moe_architecture="MixtralForCausalLM"),
    "mistral": _GGUFArchitecture("MistralForCausalLM", permuted=True),
    "qwen2": _GGUFArchitecture("Qwen2ForCausalLM"),
    "qwen2moe": _GGUFArchitecture("Qwen2MoeForCausalLM", norm_topk_prob=False),
    "qwen3": _GGUFArchitecture("Qwen3ForCausalLM", layer_tensors=_QK_NORMS),
    "qwen3moe": _GGUFArchitecture("Qwen3MoeForCausalLM", layer_tensors=_QK_NORMS),
    # Phi-3's fused projections keep their fusion: the model splits them (engine/models/phi3.py).
    "phi3": _GGUFArchitecture(
        "Phi3ForCausalLM", layer_tensors={"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}
    ),
    "gemma2": _GGUFArchitecture("Gemma2ForCausalLM", layer_tensors=_GEMMA_NORMS, norms_plus_one=True),
    "gemma3": _GGUFArchitecture(
        "Gemma3ForCausalLM", layer_tensors=_GEMMA_NORMS | _QK_NORMS, norms_plus_one=True
    ),
}
# llama.cpp's rule for Gemma's score scale: 1 / sqrt(head_dim), but 1 / sqrt(hidden / heads) for
# the 27B models (identified by their layer count).
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}


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
    num_layers = get(f"{arch}.block_count")
    head_dim = get(f"{arch}.attention.key_length", hidden_size // num_heads)
    spec = _ARCHITECTURES[arch]
    experts = _experts(gguf, arch, spec)
    architecture = spec.moe_architecture if experts and spec.moe_architecture else spec.hf_architecture
    gemma: dict[str, Any] = {}
    if arch in _GEMMA_27B_LAYERS:
        big = num_layers == _GEMMA_27B_LAYERS[arch]
        gemma = {
            "hidden_act": "gelu_pytorch_tanh",
            "query_pre_attn_scalar": hidden_size // num_heads if big else head_dim,
            "attn_logit_softcapping": get(f"{arch}.attn_logit_softcapping"),
            "final_logit_softcapping": get(f"{arch}.final_logit_softcapping"),
            "local_rope_theta": 10000.0 if arch == "gemma3" else None,
        }
    return ArchConfig(
        architecture=architecture,
        vocab_size=get(f"{arch}.vocab_size") or len(get("tokenizer.ggml.tokens", ())),
        hidden_size=hidden_size,
        intermediate_size=get(f"{arch}.feed_forward_length") or get(f"{arch}.expert_feed_forward_length"),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=get(f"{arch}.attention.head_count_kv", num_heads),
        head_dim=head_dim,
        rms_norm_eps=get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6),
        rope_theta=float(get(f"{arch}.rope.freq_base", 10000.0)),
        max_position_embeddings=get(f"{arch}.context_length", 2048),
        tie_word_embeddings="output.weight" not in tensor_names,
        qkv_bias="blk.0.attn_q.bias" in tensor_names,
        o_bias="blk.0.attn_output.bias" in tensor_names,
        rope_scaling=rope_scaling,
        eos_token_ids=tuple(token for token in [get("tokenizer.ggml.eos_token_id")] if token is not None),
        sliding_window=get(f"{arch}.attention.sliding_window"),
        layer_types=layer_types_of({}, architecture, num_layers),
        **gemma,
        **experts,
    )


def _experts(gguf: GGUFFile, arch: str, spec: _GGUFArchitecture) -> dict[str, Any]:
    """The ArchConfig fields of a mixture of experts ({} for a dense model); llama.cpp's experts
    are in every layer."""
    get = gguf.get
    num_experts = get(f"{arch}.expert_count") or 0
    if not num_experts:
        return {}
    return {
        "num_experts": num_experts,
        "num_experts_per_tok": get(f"{arch}.expert_used_count"),
        "moe_intermediate_size": get(f"{arch}.expert_feed_forward_length")
        or get(f"{arch}.feed_forward_length"),
        "shared_expert_intermediate_size": get(f"{arch}.expert_shared_feed_forward_length") or 0,
        "norm_topk_prob": bool(get(f"{arch}.expert_weights_norm", spec.norm_topk_prob)),
    }


def _hf_name(gguf_name: str, arch: _GGUFArchitecture) -> str:
    match = _LAYER_NAME.fullmatch(gguf_name)
    if match:
        layer, kind, suffix = match.groups()
        if hf_name := arch.hf_layer_tensor(kind):
            return f"model.layers.{layer}.{hf_name}.{suffix}"
    else:
        base, _, suffix = gguf_name.rpartition(".")
        if base in _GLOBAL_TENSORS:
            return f"{_GLOBAL_TENSORS[base]}.{suffix}"
    raise ValueError(f"GGUF tensor {gguf_name!r} has no place in a {arch.hf_architecture} model")


def unpermute_rotary_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Invert llama.cpp's per-head interleaving of Q/K rows (the inverse of its `permute`)."""
    half = weight.shape[0] // num_heads // 2
    return weight.reshape(num_heads, half, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def iterate_gguf_weights(path: Path, quantization: str | None = "none") -> Iterator[tuple[str, Any]]:
    """(Hugging Face name, tensor) for every tensor in the file, one at a time: the attention and MLP
    projections as `GGUFBlocks` where the quantized kernels read their format (`quantization`
    None, "strict" or "int8"), every other tensor dequantized to float32."""
    gguf = GGUFFile(path)
    arch = _architecture(gguf)
    num_heads = gguf.get(f"{arch}.attention.head_count")
    num_kv_heads = gguf.get(f"{arch}.attention.head_count_kv", num_heads)
    spec = _ARCHITECTURES[arch]
    for tensor in gguf.tensors:
        name = _hf_name(tensor.name, spec)
        values = _read_tensor(gguf, tensor, name, quantization)
        if spec.permuted and name.endswith(("q_proj.weight", "q_proj.bias")):
            values = _unpermuted(values, num_heads)
        elif spec.permuted and name.endswith(("k_proj.weight", "k_proj.bias")):
            values = _unpermuted(values, num_kv_heads)
        elif spec.norms_plus_one and name.endswith("norm.weight"):
            values = values - 1.0  # back to the checkpoint's weight (exact: the file's value is near 1)
        yield name, values


def _read_tensor(gguf: GGUFFile, tensor: GGUFTensorInfo, name: str, quantization: str | None) -> Any:
    """A projection's blocks as the file holds them where the kernels multiply by them, else its
    values; a projection in a block format without a kernel is dequantized with a warning, or
    refused with quantization "strict"."""
    if quantization != "none" and KEPT_IN_BLOCKS.search(name) and len(tensor.shape) == 2:
        if tensor.qtype in supported_ggml_types():
            return GGUFBlocks(_file_view(gguf.raw_blocks(tensor)), int(tensor.qtype), tensor.shape)
        if tensor.qtype not in _FLOAT_TYPES:
            if quantization == "strict":
                raise ValueError(
                    f"{gguf.path}: tensor {tensor.name!r} is {tensor.qtype.name}, which the quantized "
                    f"kernels do not read (quantization strict); they read "
                    f"{', '.join(supported_ggml_types().values())}"
                )
            logger.warning(
                "%s: tensor %s is %s, which the quantized kernels do not read: loaded dequantized",
                gguf.path.name,
                tensor.name,
                tensor.qtype.name,
            )
    return torch.from_numpy(gguf.dequantize(tensor))


def _file_view(raw: np.ndarray) -> torch.Tensor:
    """A read-only view of bytes in the file's map as a tensor: no copy (the layers read it once,
    packing it), and its pages are the page cache's, not the process's own memory."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(raw)


def _unpermuted(values: Any, num_heads: int) -> Any:
    if isinstance(values, GGUFBlocks):  # rows are whole blocks: permuting them permutes the weight's rows
        return values.with_rows(unpermute_rotary_rows(values.raw, num_heads))
    return unpermute_rotary_rows(values, num_heads)
