"""A step's traffic between host and device: the buffers its inputs go through, and its results
brought back in one copy (engine/transfers.py has the mechanics)."""

from __future__ import annotations

import itertools

import torch

from engine.sample.sampler import LogprobsTensors, SamplerOutput
from engine.transfers import StagedBuffer, StagingGuard, to_host


class StepBuffers:
    """The preallocated buffers a step's inputs go through (engine/transfers.py), sized by the
    scheduler's limits, and the guard that orders their reuse after the copies reading them."""

    def __init__(self, max_num_tokens: int, max_num_seqs: int, device: torch.device) -> None:
        tokens = (max_num_tokens,)
        # CPU speculative decoding attends each drafted row as an entry of its own: up to a token each.
        entries = (max(max_num_tokens, max_num_seqs),)
        self.guard = StagingGuard(device)
        self.input_ids = StagedBuffer(tokens, torch.int64, device)
        self.positions = StagedBuffer(tokens, torch.int64, device)
        self.slot_mapping = StagedBuffer(tokens, torch.int64, device)
        self.logit_rows = StagedBuffer(tokens, torch.int64, device)
        self.table_rows = StagedBuffer(entries, torch.int64, device)
        self.seq_lens = StagedBuffer(entries, torch.int64, device)
        self.query_start_loc = StagedBuffer((entries[0] + 1,), torch.int32, device)
        self.sample_rows = StagedBuffer(tokens, torch.int64, device)


def results_to_host(
    sampled: SamplerOutput | None, prompt_logprobs: dict[str, LogprobsTensors]
) -> tuple[list[int], LogprobsTensors | None, dict[str, LogprobsTensors]]:
    """The step's sampled ids, their log-probabilities and the prompt log-probabilities, brought
    to the host after one wait (engine/transfers.py `to_host`)."""
    tensors = [] if sampled is None else [sampled.sampled_token_ids]
    if sampled is not None and sampled.logprobs is not None:
        tensors += sampled.logprobs.parts()
    for logprobs in prompt_logprobs.values():
        tensors += logprobs.parts()
    fetched = iter(to_host(tensors))
    sampled_ids = [] if sampled is None else next(fetched).tolist()
    sampled_logprobs = None
    if sampled is not None and sampled.logprobs is not None:
        sampled_logprobs = LogprobsTensors(*itertools.islice(fetched, 3))
    prompt = {seq_id: LogprobsTensors(*itertools.islice(fetched, 3)) for seq_id in prompt_logprobs}
    return sampled_ids, sampled_logprobs, prompt
