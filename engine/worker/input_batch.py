"""The model runner's persistent batch: per-sequence rows that survive from step to step.

Each sequence the scheduler sends keeps one row of preallocated device tensors (its block table and
its numeric sampling settings) until it finishes or is preempted. A step applies the scheduler's
deltas to the host copies and sends only the entries that changed (a sequence's new blocks, a new
sequence's settings), without waiting; the step's rows are then gathered on the device, instead of
every table being rebuilt from Python lists into new tensors.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from engine.outputs import NewSequenceData
from engine.sample.metadata import FLOAT_COLUMNS, SamplingValues, row_values
from engine.sampling_params import SamplingParams
from engine.transfers import StagedBuffer

# An odd constant with well-mixed bits (2**64 / golden ratio): spreads consecutive positions far apart.
_GOLDEN_GAMMA = 0x9E3779B97F4A7C15


def position_seed(seed: int, position: int) -> int:
    """The seed of the draw for output token `position` of a sequence seeded with `seed`.

    Linear in the position, so a request resumed after k output tokens (a failover, with the k
    tokens moved into its prompt) whose seed is `position_seed(seed, k)` draws exactly what the
    original would have.
    """
    return (seed + position * _GOLDEN_GAMMA) % 2**64


@dataclasses.dataclass
class WorkerSequenceState:
    """What a worker keeps about one sequence from step to step (the scheduler sends it once, as
    NewSequenceData, then RunningSequenceDeltas)."""

    seq_id: str
    # Prompt + outputs: the first `num_known_tokens` sent by the scheduler, then those this worker
    # sampled since (async scheduling computes them before the scheduler knows them).
    token_ids: list[int]
    num_prompt_tokens: int
    sampling_params: SamplingParams
    seed: int | None
    eos_token_id: int | None
    num_logprobs: int | None
    num_prompt_logprobs: int | None
    num_computed_tokens: int
    row: int
    lora_int_id: int = 0  # its LoRA adapter; 0: the base model
    num_known_tokens: int = 0

    def add_known_tokens(self, new_tokens: list[int]) -> None:
        """The scheduler's tokens after those it sent before: they take the places of this worker's
        own samples (the same tokens, but for beam search, whose scheduler picks others), and own
        samples past them stay, as the values of the placeholders the step may compute."""
        start = self.num_known_tokens
        self.token_ids[start : start + len(new_tokens)] = new_tokens
        self.num_known_tokens += len(new_tokens)

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    def seed_key(self, offset: int = 0) -> int | None:
        """The key of the draw for this sequence's next token (or the one `offset` tokens after it,
        behind speculative drafts): `position_seed(seed, output position)`, None without a seed.

        A draw that is a pure function of the seed and the position (engine/sample/counter_random.py)
        lets a sequence preempted and recomputed, swapped, batched differently or speculating
        sample exactly the same tokens.
        """
        if self.seed is None:
            return None
        return position_seed(self.seed, len(self.token_ids) - self.num_prompt_tokens + offset)


class InputBatch:
    """Block-table and sampling-settings rows on the device, indexed by `WorkerSequenceState.row`,
    and the states that own them."""

    def __init__(
        self, max_num_seqs: int, max_blocks_per_seq: int, vocab_size: int, device: torch.device
    ) -> None:
        self.device = device
        self.vocab_size = vocab_size
        self._block_table = StagedBuffer((max_num_seqs, max_blocks_per_seq), torch.int64, device)
        self._floats = StagedBuffer((max_num_seqs, len(FLOAT_COLUMNS)), torch.float32, device)
        self._top_k = StagedBuffer((max_num_seqs,), torch.int64, device)
        self.seqs: dict[str, WorkerSequenceState] = {}
        self._free_rows = list(range(max_num_seqs - 1, -1, -1))

    @property
    def block_table(self) -> np.ndarray:
        """The host copy of every row's block table ([max_num_seqs, max_blocks_per_seq])."""
        return self._block_table.np

    @property
    def device_block_table(self) -> torch.Tensor:
        """The device copy, current once the step's changes are sent (`set_blocks` sends them)."""
        return self._block_table.on_device

    def sampling_values(self, rows: torch.Tensor) -> SamplingValues:
        """The sampling settings of `rows` (row indices on the device, repeats allowed)."""
        return SamplingValues(self._floats.on_device[rows], self._top_k.on_device[rows])

    def add(self, new: NewSequenceData) -> WorkerSequenceState:
        if not self._free_rows:
            raise RuntimeError("more sequences scheduled than max_num_seqs rows")
        state = WorkerSequenceState(
            seq_id=new.seq_id,
            token_ids=[*new.prompt_token_ids, *new.output_token_ids],
            num_prompt_tokens=len(new.prompt_token_ids),
            sampling_params=new.sampling_params,
            seed=new.seed,
            eos_token_id=new.eos_token_id,
            num_logprobs=new.num_logprobs,
            num_prompt_logprobs=new.num_prompt_logprobs,
            num_computed_tokens=new.num_computed_tokens,
            row=self._free_rows.pop(),
            lora_int_id=new.lora_int_id,
            num_known_tokens=len(new.prompt_token_ids) + len(new.output_token_ids),
        )
        self.seqs[new.seq_id] = state
        self.set_blocks(state, 0, new.block_ids)
        floats, top_k = row_values(new.sampling_params, self.vocab_size)
        self._floats.np[state.row] = floats
        self._top_k.np[state.row] = top_k
        self._floats.copy_rows(state.row, 0, len(FLOAT_COLUMNS))
        self._top_k.copy_rows(state.row)
        return state

    def remove(self, seq_id: str) -> None:
        state = self.seqs.pop(seq_id, None)
        if state is not None:
            self._free_rows.append(state.row)

    def set_blocks(self, state: WorkerSequenceState, start: int, block_ids: list[int]) -> None:
        """The sequence's block table from `start` on becomes `block_ids`, on the host and the device."""
        end = start + len(block_ids)
        if end > self.block_table.shape[1]:
            raise RuntimeError(f"sequence {state.seq_id} needs {end} blocks, more than max_model_len allows")
        if block_ids:
            self.block_table[state.row, start:end] = block_ids
            self._block_table.copy_rows(state.row, start, end)
