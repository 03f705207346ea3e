"""The model runner's persistent batch: per-sequence rows that survive from step to step.

Each sequence the scheduler sends keeps one row of a preallocated block table until it finishes or
is preempted; a step then only applies the scheduler's deltas and gathers the rows it needs,
instead of rebuilding every table from scratch.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from engine.outputs import NewSequenceData
from engine.sampling_params import SamplingParams

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
    generator: torch.Generator | None
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

    def seeded_generator(self, offset: int = 0) -> torch.Generator | None:
        """The generator for drawing this sequence's next token (or the one `offset` tokens after
        it, behind speculative drafts: a generator of its own), seeded from (seed, position).

        Reseeding at every position, instead of letting one stream run on, makes the draw a pure
        function of the seed and the position: a sequence preempted and recomputed, swapped,
        batched differently or speculating still samples exactly the same tokens.
        """
        if self.generator is None:
            return None
        generator = self.generator if offset == 0 else torch.Generator(device=self.generator.device)
        generator.manual_seed(position_seed(self.seed, len(self.token_ids) - self.num_prompt_tokens + offset))
        return generator


class InputBatch:
    """Block-table rows, indexed by `WorkerSequenceState.row`, and the states that own them."""

    def __init__(self, max_num_seqs: int, max_blocks_per_seq: int, device: torch.device) -> None:
        self.device = device
        self.block_table = np.zeros((max_num_seqs, max_blocks_per_seq), dtype=np.int64)
        self.seqs: dict[str, WorkerSequenceState] = {}
        self._free_rows = list(range(max_num_seqs - 1, -1, -1))

    def add(self, new: NewSequenceData) -> WorkerSequenceState:
        if not self._free_rows:
            raise RuntimeError("more sequences scheduled than max_num_seqs rows")
        generator = None if new.seed is None else torch.Generator(device=self.device)
        state = WorkerSequenceState(
            seq_id=new.seq_id,
            token_ids=[*new.prompt_token_ids, *new.output_token_ids],
            num_prompt_tokens=len(new.prompt_token_ids),
            sampling_params=new.sampling_params,
            seed=new.seed,
            generator=generator,
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
        return state

    def remove(self, seq_id: str) -> None:
        state = self.seqs.pop(seq_id, None)
        if state is not None:
            self._free_rows.append(state.row)

    def set_blocks(self, state: WorkerSequenceState, start: int, block_ids: list[int]) -> None:
        """The sequence's block table from `start` on becomes `block_ids`."""
        end = start + len(block_ids)
        if end > self.block_table.shape[1]:
            raise RuntimeError(f"sequence {state.seq_id} needs {end} blocks, more than max_model_len allows")
        self.block_table[state.row, start:end] = block_ids
