"""Settling the "auto" parts of an engine config, once: the one step from `EngineConfig` to
`ResolvedEngineConfig`.

The model's files are read here and nowhere after: the architecture travels inside the resolved
config (`config.model.hf_config`), and every later component (the front end, the core, the
workers) reads it from there.
"""

from __future__ import annotations

import os

import torch

from engine.config import (
    EngineConfig,
    ResolvedEngineConfig,
    ResolvedModelConfig,
    ResolvedSpeculativeConfig,
    ResolvedSpeculativeSection,
)
from engine.models.arch_config import ArchConfig
from engine.models.loader import weight_quantization
from engine.models.model_files import read_arch_config, resolve_model_source, valid_tensor_parallel_sizes
from engine.spec_decode.config import SpeculativeConfig
from parallel.pipeline import partition_layers


def resolve_engine_config(config: EngineConfig) -> ResolvedEngineConfig:
    """`config` with the model path, device, dtype and max_model_len made concrete and the
    architecture attached; an already resolved config is returned as it is."""
    if isinstance(config, ResolvedEngineConfig):
        return config
    source = resolve_model_source(config.model.model)
    arch = read_arch_config(source)
    device = resolve_device(config.model.device)
    max_model_len = resolve_max_model_len(config.model.max_model_len, arch, str(source.path))
    check_parallel_layout(config, arch, device)
    model = ResolvedModelConfig(
        **{
            **config.model.model_dump(),
            "model": str(source.path),
            "model_format": source.format,
            "device": device,
            "dtype": resolve_dtype(config.model.dtype, arch.torch_dtype, device),
            "max_model_len": max_model_len,
            "hf_config": arch,
        }
    )
    speculative = resolve_speculative_config(
        config.speculative.speculative_config, arch, max_model_len, runs_quantized_blocks(model)
    )
    return ResolvedEngineConfig(
        model=model,
        cache=config.cache,
        scheduler=config.scheduler,
        parallel=config.parallel,
        speculative=ResolvedSpeculativeSection(speculative_config=speculative),
        lora=config.lora,
    )


# `disable_by_batch_size` when unset and the target multiplies by quantized blocks: their int8 dot
# products cost in proportion to the rows a step verifies, unlike a dense matmul that reads the
# weights once for a few dozen rows, so drafts stop paying above a few sequences (the break-even
# measured with `python -m benchmarks.spec_decode`, README "Speculative decoding").
QUANTIZED_SPECULATION_MAX_BATCH = 4


def runs_quantized_blocks(model: ResolvedModelConfig) -> bool:
    """Whether the model's linear layers will multiply by quantized blocks (a GGUF file's, or int8);
    an int8 model where the kernels cannot run is an error here."""
    if model.model_format != "gguf" and model.quantization != "int8":
        return False
    dtype, device = getattr(torch, model.dtype), torch.device(model.device)
    return weight_quantization(model.quantization, device, dtype) != "none"


def resolve_speculative_config(
    speculative: SpeculativeConfig | None,
    target: ArchConfig,
    max_model_len: int,
    quantized_blocks: bool = False,
) -> ResolvedSpeculativeConfig | None:
    """A draft model's files read and checked against the target's: the same vocabulary (the
    drafts are the target's token ids) and room for max_model_len positions; a target running from
    quantized blocks (`quantized_blocks`) speculates by default only up to
    QUANTIZED_SPECULATION_MAX_BATCH sequences."""
    if speculative is None:
        return None
    settings = speculative.model_dump()
    if quantized_blocks and settings["disable_by_batch_size"] is None:
        settings["disable_by_batch_size"] = QUANTIZED_SPECULATION_MAX_BATCH
    if speculative.method != "draft_model":
        return ResolvedSpeculativeConfig(**settings)
    source = resolve_model_source(speculative.model)
    draft = read_arch_config(source)
    if draft.vocab_size != target.vocab_size:
        raise ValueError(
            f"speculative_config model {source.path}: its vocabulary has {draft.vocab_size} tokens, "
            f"the target's {target.vocab_size}; a draft model must share the target's tokenizer"
        )
    if draft.max_context < max_model_len:
        raise ValueError(
            f"speculative_config model {source.path}: it holds {draft.max_context} positions, fewer than "
            f"max_model_len ({max_model_len}); lower max_model_len"
        )
    return ResolvedSpeculativeConfig(
        **{**settings, "model": str(source.path)}, model_format=source.format, hf_config=draft
    )


def resolve_device(setting: str) -> str:
    """ "auto" is CUDA when torch sees a device, else the CPU; asking for an absent CUDA is an error."""
    if setting == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if setting == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' was asked for, but torch sees no CUDA device")
    return setting


def resolve_dtype(setting: str, checkpoint_dtype: str | None, device: str) -> str:
    """vLLM's rule for "auto": keep a 16-bit checkpoint's type, run float32 ones in 16 bits
    (float16 on CUDA, bfloat16 on the CPU, where float16 matmuls are slow)."""
    if setting != "auto":
        return setting
    if checkpoint_dtype == "bfloat16":
        return "bfloat16"
    return "float16" if device == "cuda" else "bfloat16"


def resolve_max_model_len(setting: int | None, arch: ArchConfig, source: str) -> int:
    """The asked-for context, else the model's; longer than the model's is an error."""
    derived_len = arch.max_context
    max_model_len = setting or derived_len
    if max_model_len > derived_len:
        raise ValueError(
            f"max_model_len ({max_model_len}) is greater than the model's context ({derived_len} tokens, "
            f"from {source})"
        )
    return max_model_len


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
    check_expert_layout(parallel.enable_expert_parallel, tp, arch)
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


def check_expert_layout(expert_parallel: bool, tp: int, arch: ArchConfig) -> None:
    """A mixture of experts splits each expert's intermediate size over the TP ranks, or under
    expert parallelism its experts: either must divide evenly."""
    if not arch.num_experts:
        if expert_parallel:
            raise ValueError(f"enable_expert_parallel: {arch.architecture} is not a mixture of experts")
        return
    if expert_parallel and arch.num_experts % tp:
        raise ValueError(
            f"enable_expert_parallel: {arch.architecture}'s {arch.num_experts} experts do not split evenly "
            f"over tensor_parallel_size {tp}"
        )
    if not expert_parallel and arch.moe_intermediate_size % tp:
        raise ValueError(
            f"{arch.architecture}'s expert intermediate size {arch.moe_intermediate_size} does not split "
            f"evenly over tensor_parallel_size {tp}; enable_expert_parallel splits the experts instead"
        )
