"""The batch one scheduling step builds for the workers, and what the workers already hold.

The workers keep state for every sequence they have been sent (engine/worker/input_batch.py), so
a step sends full `NewSequenceData` only for a sequence they do not hold (new, forked, resumed
after a preemption) and `RunningSequenceDeltas` for the others. `WorkerSequences` is the
scheduler's record of which is which, and of the sequences the workers must drop.
"""

from __future__ import annotations

import dataclasses

from engine.lora.request import LoRARequest
from engine.outputs import EngineCoreOutput, NewSequenceData, RunningSequenceDeltas, SchedulerOutput
from engine.sched.kv_cache_manager import KVCacheManager, SlotAllocation
from engine.sched.request import Request, Sequence


@dataclasses.dataclass
class StepPlan:
    """What one schedule() call accumulates into the SchedulerOutput, within a token budget."""

    budget: int
    num_scheduled: dict[str, int] = dataclasses.field(default_factory=dict)
    new_seqs: list[NewSequenceData] = dataclasses.field(default_factory=list)
    running_deltas: RunningSequenceDeltas = dataclasses.field(default_factory=RunningSequenceDeltas)
    swap_out: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    swap_in: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    copies: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    # Outputs of requests this step finished without running them (ignored, or never fitting).
    finished_outputs: list[EngineCoreOutput] = dataclasses.field(default_factory=list)
    # Speculative drafts by sequence (SchedulerOutput.scheduled_spec_decode_tokens), and the
    # sequences a draft model proposes for after the step.
    drafts: dict[str, list[int]] = dataclasses.field(default_factory=dict)
    draft_seq_ids: list[str] = dataclasses.field(default_factory=list)
    lora_loads: dict[int, LoRARequest] = dataclasses.field(default_factory=dict)

    def to_scheduler_output(self, finished_seq_ids: list[str]) -> SchedulerOutput:
        return SchedulerOutput(
            scheduled_new_seqs=self.new_seqs,
            scheduled_cached_seqs=self.running_deltas,
            num_scheduled_tokens=self.num_scheduled,
            total_num_scheduled_tokens=sum(self.num_scheduled.values()),
            finished_seq_ids=finished_seq_ids,
            blocks_to_swap_out=self.swap_out,
            blocks_to_swap_in=self.swap_in,
            blocks_to_copy=self.copies,
            scheduled_spec_decode_tokens=self.drafts,
            draft_seq_ids=self.draft_seq_ids,
            lora_loads=self.lora_loads,
        )


class WorkerSequences:
    """The sequences the workers hold state for, and those they must drop at the next step."""

    def __init__(self) -> None:
        # Tokens of each sequence the workers have been sent; absent: the workers do not hold it.
        self.num_tokens_sent: dict[str, int] = {}
        self._to_drop: set[str] = set()

    def record(
        self,
        seq: Sequence,
        num_new_tokens: int,
        allocation: SlotAllocation,
        kv: KVCacheManager,
        plan: StepPlan,
    ) -> None:
        """Add a scheduled sequence to the step: full data if the workers lack it, deltas if not."""
        sent = self.num_tokens_sent.get(seq.seq_id)
        if sent is None:
            plan.new_seqs.append(_new_sequence_data(seq, kv.block_ids(seq.seq_id)))
        else:
            deltas = plan.running_deltas
            deltas.seq_ids.append(seq.seq_id)
            deltas.new_token_ids.append(seq.all_token_ids[sent:])
            deltas.block_table_starts.append(allocation.table_start)
            deltas.new_block_ids.append(allocation.block_ids)
            deltas.num_computed_tokens.append(seq.num_computed_tokens)
        plan.num_scheduled[seq.seq_id] = num_new_tokens
        seq.num_computed_tokens += num_new_tokens
        self.num_tokens_sent[seq.seq_id] = seq.num_tokens

    def drop(self, seq_id: str) -> None:
        """The workers must drop the sequence (preempted: it comes back as new data)."""
        self.num_tokens_sent.pop(seq_id, None)
        self._to_drop.add(seq_id)

    def forget(self, seq_id: str) -> None:
        """A finished sequence: the workers drop it if they hold it."""
        if self.num_tokens_sent.pop(seq_id, None) is not None:
            self._to_drop.add(seq_id)

    def take_dropped(self) -> list[str]:
        """The sequences to drop, for this step's SchedulerOutput (each reported once)."""
        dropped = sorted(self._to_drop)
        self._to_drop.clear()
        return dropped


def _new_sequence_data(seq: Sequence, block_ids: list[int]) -> NewSequenceData:
    request = seq.request
    params = request.sampling_params
    return NewSequenceData(
        seq_id=seq.seq_id,
        prompt_token_ids=request.prompt_token_ids,
        output_token_ids=list(seq.output_token_ids),
        sampling_params=params,
        block_ids=block_ids,
        num_computed_tokens=seq.num_computed_tokens,
        eos_token_id=request.eos_token_id,
        seed=None if params.seed is None else (params.seed + seq.index) % 2**64,  # a uint64 on the wire
        num_logprobs=_num_logprobs(request),
        num_prompt_logprobs=params.prompt_logprobs if seq.index == 0 else None,
        lora_int_id=0 if request.lora_request is None else request.lora_request.lora_int_id,
    )


def _num_logprobs(request: Request) -> int | None:
    """Top-k log-probabilities the workers return per sampled token, for this request's sequences."""
    if request.beam_search is not None:
        return 2 * request.beam_search.beam_width  # the candidates of every beam
    params = request.sampling_params
    if params.logprobs is None and params.num_sequences > params.n:
        return 0  # best_of ranks sequences by cumulative log-probability
    return params.logprobs
