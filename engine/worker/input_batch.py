"""The model runner's persistent batch: per-request rows that survive from step to step.

Each request the scheduler sends keeps one row of preallocated arrays (block table, sampling
settings) until it finishes or is preempted; a step then only applies the scheduler's deltas and
gathers the rows it needs, instead of rebuilding everything from scratch.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from engine.outputs import NewRequestData
from engine.sampling_params import SamplingParams


@dataclasses.dataclass
class CachedRequestState:
    """What a worker knows about one request."""

    req_id: str
    token_ids: list[int]  # prompt + the outputs the scheduler has sent
    sampling_params: SamplingParams
    generator: torch.Generator | None
    num_computed_tokens: int
    row: int


class InputBatch:
    """Rows of block tables and sampling parameters, indexed by `CachedRequestState.row`."""

    def __init__(
        self, max_num_reqs: int, max_blocks_per_req: int, vocab_size: int, device: torch.device
    ) -> None:
        self.device = device
        self.vocab_size = vocab_size
        self.block_table = np.zeros((max_num_reqs, max_blocks_per_req), dtype=np.int64)
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int64)
        self.temperature = np.ones(max_num_reqs, dtype=np.float32)
        self.top_p = np.ones(max_num_reqs, dtype=np.float32)
        self.top_k = np.full(max_num_reqs, vocab_size, dtype=np.int64)
        self.requests: dict[str, CachedRequestState] = {}
        self._free_rows = list(range(max_num_reqs - 1, -1, -1))

    def add(self, new: NewRequestData) -> CachedRequestState:
        if not self._free_rows:
            raise RuntimeError("more requests scheduled than max_num_seqs rows")
        row = self._free_rows.pop()
        params = new.sampling_params
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(params.seed)
        state = CachedRequestState(
            req_id=new.req_id,
            token_ids=[*new.prompt_token_ids, *new.output_token_ids],
            sampling_params=params,
            generator=generator,
            num_computed_tokens=new.num_computed_tokens,
            row=row,
        )
        self.requests[new.req_id] = state
        self.num_blocks[row] = 0
        self.append_blocks(state, new.block_ids)
        self.temperature[row] = params.temperature
        self.top_p[row] = params.top_p
        self.top_k[row] = params.top_k if params.top_k > 0 else self.vocab_size
        return state

    def remove(self, req_id: str) -> None:
        state = self.requests.pop(req_id, None)
        if state is not None:
            self._free_rows.append(state.row)

    def append_blocks(self, state: CachedRequestState, block_ids: list[int]) -> None:
        start = self.num_blocks[state.row]
        end = start + len(block_ids)
        if end > self.block_table.shape[1]:
            raise RuntimeError(f"request {state.req_id} needs {end} blocks, more than max_model_len allows")
        self.block_table[state.row, start:end] = block_ids
        self.num_blocks[state.row] = end
