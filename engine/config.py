"""Engine configuration: one pydantic model per concern, assembled into `EngineConfig`.

Users meet these settings as flat keyword arguments (`LLM(max_num_seqs=64)`), flat YAML keys and
dashed CLI flags (`--max-num-seqs`). Every flat key belongs to exactly one section, so
`EngineConfig.from_flat` routes it there, and an unknown key is an error that names it.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic.fields import FieldInfo

from engine.models.arch_config import ArchConfig
from engine.spec_decode.config import SpeculativeConfig, parse_speculative_config

DType = Literal["auto", "float32", "bfloat16", "float16"]
ExecutorBackend = Literal["uni", "mp", "ray"]
# kernels.attention.selector.BACKEND_NAMES; spelled out here so that reading a config imports no torch.
AttentionBackendName = Literal["auto", "torch", "triton", "flash_attn", "cpu_paged", "sdpa", "reference"]
# The default waiting queue of a server's engine, in batches of max_num_seqs.
DEFAULT_WAITING_BATCHES = 3

_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_memory_size(value: int | str) -> int:
    """Bytes from an int or a string such as "4GiB", "512 MB" or "1e9"."""
    if isinstance(value, int):
        return value
    match = re.fullmatch(r"\s*([0-9.eE+]+)\s*([A-Za-z]*)\s*", value)
    if not match or match.group(2).lower() not in _SIZE_UNITS:
        raise ValueError(f"cannot read {value!r} as a memory size: use bytes or a string like '4GiB'")
    return int(float(match.group(1)) * _SIZE_UNITS[match.group(2).lower()])


class _Section(BaseModel):
    # Frozen: a resolved config shares its unchanged sections with the config it came from, so a
    # section that could change would change both.
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelConfig(_Section):
    """Which weights to run, in which precision, on which device."""

    model: str | None = Field(
        None,
        description="Hugging Face folder (config.json + safetensors) or GGUF file; "
        "None means the packaged SmolLM2-135M-Instruct GGUF",
    )
    tokenizer: str | None = Field(None, description="Tokenizer folder; defaults to the model's own")
    dtype: DType = Field(
        "auto", description="Weight and activation dtype; auto picks the checkpoint's 16-bit type"
    )
    quantization: Literal["none", "strict", "int8"] | None = Field(
        None,
        description="GGUF projections stay in their blocks on the CPU where the kernels read the format "
        "(Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K; others dequantized with a warning); none: dequantize "
        "every tensor at load; strict: refuse a projection the kernels do not read; int8: also "
        "quantize every float projection at load to int8 blocks of 32 with a scale each (W8A8; "
        "bfloat16 on the CPU)",
    )
    seed: int = Field(0, description="Seed of the random sampler for requests without their own seed")
    max_model_len: int | None = Field(
        None, gt=0, description="Longest prompt plus output, in tokens; defaults to the model's context"
    )
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto picks CUDA when present")
    attention_backend: AttentionBackendName = Field(
        "auto",
        description="auto: flash_attn on CUDA where it can run, else triton, else torch; cpu_paged "
        "elsewhere ($RAYPAGE_ATTENTION_BACKEND overrides auto). A backend that cannot run here is an error",
    )
    enforce_eager: bool = Field(
        False,
        description="Run every step eagerly; False captures CUDA graphs of decode steps on CUDA (as vLLM)",
    )
    max_logprobs: int = Field(20, ge=0, description="Most log-probabilities a request may ask for per token")


class CacheConfig(_Section):
    """How the paged KV cache is laid out and sized."""

    block_size: int = Field(16, gt=0, le=1024, description="Tokens per KV cache block")
    enable_prefix_caching: bool = Field(True, description="Share full blocks between equal prefixes")
    kv_cache_dtype: Literal["auto", "int8"] = Field(
        "auto",
        description="KV cache element type; auto: the model's dtype; int8: rows quantized per token and KV "
        "head (a float32 scale each), about half a 16-bit cache's bytes, on the CPU with the cpu_paged "
        "attention backend only",
    )
    kv_cache_memory: int | None = Field(
        None, description="Bytes for the KV cache on the CPU (int or string like '4GiB'); default 4GiB"
    )
    num_kv_blocks: int | None = Field(
        None, gt=0, description="Exact number of KV blocks; overrides the memory-based sizing"
    )
    gpu_memory_utilization: float = Field(
        0.9, gt=0.0, le=1.0, description="Share of GPU memory the engine may use on CUDA"
    )
    swap_space: float = Field(
        4.0,
        ge=0.0,
        description="GiB of host memory per worker for KV blocks swapped out of the device, at most "
        "what max_num_seqs sequences of max_model_len tokens fill",
    )

    @field_validator("kv_cache_memory", mode="before")
    @classmethod
    def _parse_size(cls, value: Any) -> Any:
        if value is None:
            return None
        size = parse_memory_size(value)
        if size <= 0:
            raise ValueError("kv_cache_memory must be positive")
        return size


class SchedulerConfig(_Section):
    """Limits of one continuous-batching step."""

    max_num_seqs: int = Field(256, gt=0, description="Most requests in one step")
    max_num_batched_tokens: int = Field(2048, gt=0, description="Token budget of one step")
    preemption_mode: Literal["recompute", "swap"] | None = Field(
        None,
        description="How to evict a running request when blocks run out; None: recompute a single "
        "sequence, swap a group of sequences (parallel sampling, beam search) to the CPU",
    )
    async_scheduling: bool = Field(
        False,
        description="Schedule the next step while the current one runs, its sampled tokens "
        "placeholders the workers fill in (stops take effect one step late, as in vLLM); requests "
        "with beam search or a grammar, and speculative decoding, run in plain steps",
    )
    max_waiting_requests: int | None = Field(
        None,
        ge=-1,
        description="Requests a server's engine admits beyond max_num_seqs (its waiting queue); past "
        "max_num_seqs + this, new requests are refused (HTTP 503 with Retry-After). None: "
        f"{DEFAULT_WAITING_BATCHES} x max_num_seqs; -1: no bound. The offline LLM never refuses",
    )

    @property
    def max_admitted_requests(self) -> int | None:
        """Unfinished requests a server's engine holds at most (running + waiting); None: no bound.

        The default waiting queue is a few times max_num_seqs, the most one step runs (and the batch
        the workers profile memory at): a request past it would wait behind several full batches, and
        gains more from a 503 it can retry elsewhere than from a queue that only grows.
        """
        waiting = self.max_waiting_requests
        if waiting is None:
            waiting = DEFAULT_WAITING_BATCHES * self.max_num_seqs
        return None if waiting == -1 else self.max_num_seqs + waiting


class ParallelConfig(_Section):
    """How the model is split across workers."""

    tensor_parallel_size: int = Field(1, ge=1, description="Workers sharing each layer")
    pipeline_parallel_size: int = Field(1, ge=1, description="Stages the layers are split into")
    distributed_executor_backend: ExecutorBackend | None = Field(
        None, description="uni, mp or ray; None picks uni for one worker, mp for several"
    )
    pipeline_partition: list[int] | None = Field(
        None, description="Layers per pipeline stage, first to last; None splits them evenly"
    )
    enable_expert_parallel: bool = Field(
        False,
        description="Mixture-of-experts models: each tensor-parallel worker holds whole experts (a "
        "tensor_parallel_size-th of them) instead of a slice of every expert",
    )
    ray_address: str | None = Field(
        None,
        description="Ray cluster the ray executor joins ('auto', or host:port); None joins a running "
        "one, or starts a local one when none runs",
    )
    placement_strategy: Literal["PACK", "STRICT_PACK", "SPREAD"] = Field(
        "PACK", description="How the ray executor's placement group spreads worker bundles over nodes"
    )
    placement_bundle: dict[str, float] | None = Field(
        None, description="Resources of one worker's bundle; None: {GPU: 1} on CUDA, {CPU: 1} on the CPU"
    )
    placement_timeout_s: float = Field(
        60.0, gt=0, description="Seconds to wait for the cluster to grant the placement group"
    )
    placement_group_id: str | None = Field(
        None,
        description="Hex id of an existing placement group whose bundle i hosts worker rank i; None: the "
        "one the caller runs in (a Serve replica's), else a new one",
    )

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def executor_backend(self) -> ExecutorBackend:
        """The backend in effect: the one asked for, else uni for one worker and mp for several."""
        return self.distributed_executor_backend or ("uni" if self.world_size == 1 else "mp")


class SpeculativeSection(_Section):
    """Speculative decoding: proposals verified by the model in one forward pass."""

    speculative_config: SpeculativeConfig | None = Field(
        None,
        description='vLLM\'s speculative_config, a mapping or JSON: {"method": "ngram", '
        '"num_speculative_tokens": K, "prompt_lookup_max": N, "prompt_lookup_min": M, '
        '"disable_by_batch_size": B}; None: no speculation',
    )

    @field_validator("speculative_config", mode="before")
    @classmethod
    def _parse(cls, value: Any) -> Any:
        return parse_speculative_config(value)


class LoRAConfig(_Section):
    """LoRA adapters served on top of the base model (vLLM's names and defaults)."""

    enable_lora: bool = Field(False, description="Serve LoRA adapters (PEFT folders) beside the base model")
    max_loras: int = Field(1, ge=1, description="Adapters one step can run (device slots)")
    max_lora_rank: int = Field(16, ge=1, le=512, description="Highest adapter rank accepted")
    max_cpu_loras: int | None = Field(
        None, ge=1, description="Adapters kept loaded in host memory (an LRU cache); None: max_loras"
    )

    @model_validator(mode="after")
    def _cpu_cache_holds_slots(self) -> LoRAConfig:
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"max_cpu_loras ({self.max_cpu_loras}) must be at least max_loras ({self.max_loras})"
            )
        return self

    @property
    def host_cache_size(self) -> int:
        return self.max_cpu_loras or self.max_loras


_SECTIONS: dict[str, type[_Section]] = {
    "model": ModelConfig,
    "cache": CacheConfig,
    "scheduler": SchedulerConfig,
    "parallel": ParallelConfig,
    "speculative": SpeculativeSection,
    "lora": LoRAConfig,
}


class EngineConfig(BaseModel):
    """Everything an engine needs, grouped by the component that reads it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: ModelConfig = Field(default_factory=ModelConfig)
    cache: CacheConfig = Field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    speculative: SpeculativeSection = Field(default_factory=SpeculativeSection)
    lora: LoRAConfig = Field(default_factory=LoRAConfig)

    @model_validator(mode="after")
    def _check_batch_limits(self) -> EngineConfig:
        if self.scheduler.max_num_batched_tokens < self.scheduler.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.scheduler.max_num_batched_tokens}) must be at least "
                f"max_num_seqs ({self.scheduler.max_num_seqs}) so that every running request can decode"
            )
        return self

    @staticmethod
    def flat_fields() -> dict[str, tuple[str, FieldInfo]]:
        """Every flat key -> (its section, its pydantic field)."""
        return {
            name: (section, info)
            for section, model in _SECTIONS.items()
            for name, info in model.model_fields.items()
        }

    @classmethod
    def from_flat(cls, **settings: Any) -> EngineConfig:
        """Build from flat keys (LLM keyword arguments, YAML keys, CLI flags)."""
        owners = cls.flat_fields()
        grouped: dict[str, dict[str, Any]] = {section: {} for section in _SECTIONS}
        for key, value in settings.items():
            if key not in owners:
                raise ValueError(
                    f"unknown engine config key {key!r}; known keys: {', '.join(sorted(owners))}"
                )
            grouped[owners[key][0]][key] = value
        return cls(**{section: _SECTIONS[section](**values) for section, values in grouped.items()})

    @classmethod
    def from_yaml(cls, path: str | Path, **overrides: Any) -> EngineConfig:
        """Load a flat YAML mapping; keyword overrides win over the file."""
        return cls.from_flat(**{**load_yaml_mapping(path), **overrides})

    def to_flat(self) -> dict[str, Any]:
        """The flat keys `from_flat` reads back (a resolved config's extra fields are left out)."""
        owners = self.flat_fields()
        return {
            key: value
            for section in _SECTIONS
            for key, value in getattr(self, section).model_dump().items()
            if key in owners
        }


class ResolvedModelConfig(ModelConfig):
    """A `ModelConfig` with every "auto" settled against the checkpoint and this machine, and the
    checkpoint's architecture attached (vLLM's `ModelConfig.hf_config`): read from disk once, by
    `resolve_engine_config`, so that no later component reads the files again."""

    model: str = Field(description="The local weights: a Hugging Face folder or a .gguf file")
    model_format: Literal["hf", "gguf"]
    dtype: Literal["float32", "bfloat16", "float16"]
    max_model_len: int = Field(gt=0)
    device: Literal["cpu", "cuda"]
    hf_config: ArchConfig


class ResolvedSpeculativeConfig(SpeculativeConfig):
    """A `SpeculativeConfig` with a draft model's path made concrete and its architecture attached."""

    model_format: Literal["hf", "gguf"] | None = None
    hf_config: ArchConfig | None = None


class ResolvedSpeculativeSection(SpeculativeSection):
    speculative_config: ResolvedSpeculativeConfig | None = None


class ResolvedEngineConfig(EngineConfig):
    """An `EngineConfig` after `engine.config_resolve.resolve_engine_config`, and the only kind the
    engine core, the executors and the workers accept. Frozen; it crosses process boundaries as
    `model_dump_json()` / `model_validate_json()` (the core process) or by pickle (the workers)."""

    model: ResolvedModelConfig
    speculative: ResolvedSpeculativeSection = Field(default_factory=ResolvedSpeculativeSection)


def load_yaml_mapping(path: str | Path) -> dict[str, Any]:
    """A YAML file's top-level mapping, with an error that names the file otherwise."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"config file {path} does not exist")
    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict):
        raise ValueError(
            f"config file {path} must hold a mapping of engine settings, got {type(data).__name__}"
        )
    return data


def checked_flat_settings(
    path: str | Path | None,
    overrides: Mapping[str, Any],
    file_label: str,
    override_name: Callable[[str], str] = str,
) -> dict[str, Any]:
    """The flat settings of the YAML file at `path` (if any) with `overrides` on top, checked by
    building an `EngineConfig` from them, so that callers fail before loading any weights.

    A ValueError names where each bad value came from: `override_name(key)` for an override (a
    command-line flag, say), "KEY in FILE" for the file; errors of the file itself start with
    `file_label` and its path.
    """
    file_settings: dict[str, Any] = {}
    if path is not None:
        try:
            file_settings = load_yaml_mapping(path)
        except (OSError, yaml.YAMLError, ValueError) as exc:
            raise ValueError(f"{file_label} {path}: {exc}") from None
    settings = {**file_settings, **overrides}
    try:
        EngineConfig.from_flat(**settings)
    except ValidationError as exc:
        origin = {key: override_name(key) if key in overrides else f"{key} in {path}" for key in settings}
        raise ValueError(describe_validation_error(exc, lambda key: origin.get(key, key))) from None
    except ValueError as exc:  # an unknown key
        raise ValueError(f"{file_label} {path}: {exc}" if path is not None else str(exc)) from None
    return settings


def describe_validation_error(exc: ValidationError, name: Callable[[str], str] = str) -> str:
    """One clause per error, "NAME: message (got value)", with the key named as `name` says."""
    clauses = []
    for error in exc.errors():
        # A validator's own ValueError reads better without pydantic's "Value error, " prefix.
        message = str(error["ctx"]["error"]) if error["type"] == "value_error" else error["msg"]
        if error["loc"]:
            clauses.append(f"{name(str(error['loc'][0]))}: {message} (got {error['input']!r})")
        else:  # a check across fields, whose message names them
            clauses.append(message)
    return "; ".join(clauses)
