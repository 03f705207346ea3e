"""The typed messages that cross a boundary, each exactly one.

front end -> core:       EngineCoreRequest, AbortRequests, StopSequence, UtilityRequest
core -> front end:       EngineCoreOutputs, UtilityOutput, EngineCoreReady, EngineCoreFailure
scheduler -> workers:    SchedulerOutput (full data for new requests, deltas for running ones)
last stage -> scheduler: ModelRunnerOutput
front end -> user:       RequestOutput / CompletionOutput

They are msgspec Structs, sent as msgpack (faster than pickle, and typed on decoding): over ZeroMQ,
and each step's SchedulerOutput from the mp and ray executors to their workers (a worker's answer
rides back in the executor's own pickled reply). Over ZeroMQ each message is two frames: its type
(`EngineCoreRequestType` / `EngineCoreOutputType`, one byte) and its msgpack body, so the receiver
decodes the body straight into the right Struct.
"""

from __future__ import annotations

import enum
from concurrent.futures import Future

import msgspec

from engine.lora.request import LoRARequest
from engine.sampling_params import BeamSearchParams, SamplingParams


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
    beam_search: BeamSearchParams | None = None
    # Tenant isolation of the prefix cache: a non-empty salt mixed into the first block's hash.
    cache_salt: str | None = None
    lora_request: LoRARequest | None = None


class LogprobsLists(msgspec.Struct, array_like=True):
    """Log-probabilities at some positions: column 0 is the chosen token, then the top-k in order."""

    token_ids: list[list[int]]
    logprobs: list[list[float]]
    ranks: list[int]  # rank of each chosen token (1 = the most likely)

    def __len__(self) -> int:
        return len(self.ranks)

    def slice(self, start: int, end: int) -> LogprobsLists:
        return LogprobsLists(self.token_ids[start:end], self.logprobs[start:end], self.ranks[start:end])


class NewSequenceData(msgspec.Struct, array_like=True, omit_defaults=True):
    """Everything a worker needs about a sequence it does not hold (new, forked, resumed)."""

    seq_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    eos_token_id: int | None = None
    seed: int | None = None  # this sequence's own seed (forks of a seeded request differ)
    num_logprobs: int | None = None  # top-k log-probabilities to return per sampled token
    num_prompt_logprobs: int | None = None
    lora_int_id: int = 0  # its adapter (LoRARequest.lora_int_id); 0: the base model


class RunningSequenceDeltas(msgspec.Struct, array_like=True, omit_defaults=True):
    """One step's changes to sequences the workers already hold (each worker keeps a
    `WorkerSequenceState` per sequence), as index-aligned lists.

    A sequence's block table changes only from `block_table_starts[i]` on: new blocks are appended
    there, and a copy-on-write replaces the block being written.
    """

    seq_ids: list[str] = msgspec.field(default_factory=list)
    new_token_ids: list[list[int]] = msgspec.field(default_factory=list)
    block_table_starts: list[int] = msgspec.field(default_factory=list)
    new_block_ids: list[list[int]] = msgspec.field(default_factory=list)
    num_computed_tokens: list[int] = msgspec.field(default_factory=list)


class GrammarBitmask(msgspec.Struct, array_like=True):
    """The allowed tokens of a step's rows under a grammar (structured outputs): row i, of `words`
    int32 words, is `seq_ids[i]`'s mask (bit t % 32 of word t // 32 allows token t). The workers set
    every logit a row's mask refuses to -inf before any sampling processor runs."""

    seq_ids: list[str]
    words: int
    data: bytearray  # [len(seq_ids), words] int32, little-endian (writable: the workers view it)


# A step's grammar masks while the engine core computes them (beside the forward pass).
PendingBitmask = Future  # Future[GrammarBitmask]


class SchedulerOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    """One step's batch: which sequences run, how many tokens each computes, and the block moves
    to make first (swaps out, swaps in, copies, in that order)."""

    scheduled_new_seqs: list[NewSequenceData]
    scheduled_cached_seqs: RunningSequenceDeltas
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    finished_seq_ids: list[str] = msgspec.field(default_factory=list)
    blocks_to_swap_out: list[tuple[int, int]] = msgspec.field(default_factory=list)  # (device, cpu)
    blocks_to_swap_in: list[tuple[int, int]] = msgspec.field(default_factory=list)  # (cpu, device)
    blocks_to_copy: list[tuple[int, int]] = msgspec.field(default_factory=list)  # (device, device)
    grammar_bitmask: GrammarBitmask | None = None
    # Speculative decoding: the drafts each sequence computes after its last token (its
    # num_scheduled_tokens counts them), for the workers to verify.
    scheduled_spec_decode_tokens: dict[str, list[int]] = msgspec.field(default_factory=dict)
    # Sequences a draft model proposes for after this step (the scheduler allocated their lookahead slots).
    draft_seq_ids: list[str] = msgspec.field(default_factory=list)
    # LoRA adapters to load into device slots before the step, by slot (each replaces the slot's
    # adapter): the scheduler owns the slots, so every worker holds the same adapter in each.
    lora_loads: dict[int, LoRARequest] = msgspec.field(default_factory=dict)

    @property
    def has_block_moves(self) -> bool:
        return bool(self.blocks_to_swap_out or self.blocks_to_swap_in or self.blocks_to_copy)


class ModelRunnerOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    """Tokens sampled this step, for the sequences that reached the end of their known tokens."""

    seq_ids: list[str]
    sampled_token_ids: list[list[int]]
    # Per sampled sequence, when it asked for them: one position each.
    logprobs: list[LogprobsLists | None] = msgspec.field(default_factory=list)
    # Per sequence computing prompt tokens with prompt_logprobs: the positions this step covered.
    prompt_logprobs: dict[str, LogprobsLists] = msgspec.field(default_factory=dict)
    # A draft model's proposals for the next step, by sequence (SchedulerOutput.draft_seq_ids).
    spec_token_ids: dict[str, list[int]] = msgspec.field(default_factory=dict)


class SpecDecodeStats(msgspec.Struct, array_like=True, omit_defaults=True):
    """Running totals of speculative decoding (vLLM's spec_decode metrics): sequences that took
    drafts in a step, the drafts, those accepted, and those accepted at each position 1..k."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = msgspec.field(default_factory=list)


class LoRAStats(msgspec.Struct, array_like=True, omit_defaults=True):
    """LoRA adapters (vLLM's lora_requests_info, and running totals): the adapters of the running
    and waiting requests (request counts by adapter name), the device slots, and how many times an
    adapter was loaded into a slot and how many of those loads evicted another one."""

    running: dict[str, int] = msgspec.field(default_factory=dict)
    waiting: dict[str, int] = msgspec.field(default_factory=dict)
    max_loras: int = 0
    num_loads: int = 0
    num_evictions: int = 0


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
    # Blocks the running sequences' tables point to, shared blocks counted once per sequence: what
    # they would take without sharing (the physical count is kv_slots_allocated / block_size).
    kv_logical_blocks: int = 0
    # Structured outputs, running totals: requests under a grammar, grammars compiled (and the
    # seconds that took, off the step loop), and requests whose grammar was already compiled.
    structured_output_requests: int = 0
    grammar_compiles: int = 0
    grammar_compile_seconds: float = 0.0
    grammar_cache_hits: int = 0
    spec_decode: SpecDecodeStats | None = None  # None without speculative decoding
    lora: LoRAStats | None = None  # None without enable_lora


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    """New tokens of one sequence (`index` within its request), and why it finished if it did.

    Beam search reports each final beam once, at the end, with all its tokens.
    """

    request_id: str
    index: int
    new_token_ids: list[int]
    new_logprobs: LogprobsLists | None = None
    prompt_logprobs: LogprobsLists | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    cumulative_logprob: float | None = None
    error: str | None = None
    # Set on the last output of a request the core has finished with (all its sequences done).
    request_finished: bool = False
    # time.time() when the scheduler first scheduled the request; on its first output only.
    first_scheduled_time: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True):
    """Everything one step produced."""

    outputs: list[EngineCoreOutput] = msgspec.field(default_factory=list)
    scheduler_stats: SchedulerStats | None = None


class EngineCoreRequestType(bytes, enum.Enum):
    """First frame of a message to the core process: how to decode the second."""

    ADD = b"\x00"  # EngineCoreRequest
    ABORT = b"\x01"  # AbortRequests
    STOP_SEQUENCE = b"\x02"  # StopSequence
    UTILITY = b"\x03"  # UtilityRequest


class EngineCoreOutputType(bytes, enum.Enum):
    """First frame of a message from the core process: how to decode the second."""

    OUTPUTS = b"\x00"  # EngineCoreOutputs
    UTILITY = b"\x01"  # UtilityOutput
    READY = b"\x02"  # EngineCoreReady
    FAILURE = b"\x03"  # EngineCoreFailure


class AbortRequests(msgspec.Struct, array_like=True):
    """Finish these requests and free their blocks; unknown or finished ids are ignored."""

    request_ids: list[str]


class StopSequence(msgspec.Struct, array_like=True):
    """The front end matched a stop string in sequence `index`: finish it in the core."""

    request_id: str
    index: int
    stop_reason: str


class UtilityRequest(msgspec.Struct, array_like=True):
    """Call an EngineCore method by name (from a fixed list) and answer with a UtilityOutput."""

    call_id: int
    method: str
    args: list = msgspec.field(default_factory=list)


class UtilityOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    """The answer to UtilityRequest `call_id`: the msgpack-encoded result, or the error's message.

    The result stays raw here because only the caller knows its type (`get_stats` answers a
    SchedulerStats): it decodes it with that type.
    """

    call_id: int
    result: msgspec.Raw = msgspec.field(default_factory=lambda: msgspec.Raw(b"\xc0"))  # msgpack nil
    error: str | None = None


class EngineCoreReady(msgspec.Struct, array_like=True):
    """The core process built its EngineCore (workers, model, KV cache) and reads requests now."""

    scheduler_stats: SchedulerStats


class EngineCoreFailure(msgspec.Struct, array_like=True):
    """The core process failed (at startup, or in its step loop) and exits: the error's message."""

    message: str


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
    lora_request: LoRARequest | None = None  # the adapter it ran with


class BeamSearchSequence(msgspec.Struct, kw_only=True):
    """One finished beam (vLLM's fields): `tokens` holds the prompt and the generated tokens."""

    tokens: list[int]
    text: str
    cum_logprob: float
    num_prompt_tokens: int
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    @property
    def output_token_ids(self) -> list[int]:
        return self.tokens[self.num_prompt_tokens :]


class BeamSearchOutput(msgspec.Struct, kw_only=True):
    """The beams of one prompt, best score first."""

    sequences: list[BeamSearchSequence]
