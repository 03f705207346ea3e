"""The typed messages that cross a boundary, each exactly one.

front end -> core:       EngineCoreRequest
scheduler -> workers:    SchedulerOutput (full data for new requests, deltas for running ones)
last stage -> scheduler: ModelRunnerOutput
core -> front end:       EngineCoreOutputs
front end -> user:       RequestOutput / CompletionOutput

They are msgspec Structs so that the ZeroMQ and Ray paths serialize them without pickle.
"""

from __future__ import annotations

import enum

import msgspec

from engine.sampling_params import SamplingParams


class FinishReason(enum.IntEnum):
    """Why a request stopped; `str()` gives the OpenAI spelling."""

    STOP = 0
    LENGTH = 1
    ABORT = 2

    def __str__(self) -> str:
        return self.name.lower()


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True):
    """A tokenized, validated request on its way into the scheduler."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None
    arrival_time: float
    priority: int = 0


class NewRequestData(msgspec.Struct, array_like=True, omit_defaults=True):
    """Everything a worker needs about a request it has not seen (or dropped at preemption)."""

    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int


class CachedRequestData(msgspec.Struct, array_like=True, omit_defaults=True):
    """Deltas for requests the workers already hold, index-aligned lists."""

    req_ids: list[str] = msgspec.field(default_factory=list)
    new_token_ids: list[list[int]] = msgspec.field(default_factory=list)
    new_block_ids: list[list[int]] = msgspec.field(default_factory=list)
    num_computed_tokens: list[int] = msgspec.field(default_factory=list)


class SchedulerOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    """One step's batch: which requests run and how many tokens each computes."""

    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    finished_req_ids: list[str] = msgspec.field(default_factory=list)


class ModelRunnerOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    """Tokens sampled this step, for the requests that reached the end of their known tokens."""

    req_ids: list[str]
    sampled_token_ids: list[list[int]]


class SchedulerStats(msgspec.Struct, array_like=True, omit_defaults=True):
    """Counters the scheduler reports after each step (and `LLM.get_stats()` returns)."""

    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0
    num_kv_blocks: int = 0
    num_preemptions: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    # Tokens whose KV the running requests hold, and the slots of the blocks allocated to them:
    # their ratio is the KV cache's utilization (the paper's measure of waste).
    kv_tokens_held: int = 0
    kv_slots_allocated: int = 0


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    """New tokens of one request, and why it finished if it did."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    error: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True):
    """Everything one step produced."""

    outputs: list[EngineCoreOutput] = msgspec.field(default_factory=list)
    scheduler_stats: SchedulerStats | None = None


class CompletionOutput(msgspec.Struct, kw_only=True):
    """One generated sequence of a request (vLLM's fields)."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


class RequestOutput(msgspec.Struct, kw_only=True):
    """What the user gets for one request (vLLM's fields)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    prompt_logprobs: list | None = None
    error: str | None = None
