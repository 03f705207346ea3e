"""Sampling rows of a step with speculative drafts, and the drafts each sequence's samples accept.

A sequence that computed its last token and k drafts has k + 1 positions to sample: position j
samples as if drafts 1..j had been generated (its penalties, min_tokens and seed see them), so a
draft is accepted where the token sampled before it equals it. The sequence's tokens are the drafts
accepted, then the first token sampled differently (or the token after the last draft). For the
point-mass proposals of n-gram lookup this is the rejection sampler of speculative decoding: the
output keeps the target model's distribution, and is the same token for token as decoding one at a
time wherever the draws are the same (greedy, or seeded).
"""

from __future__ import annotations

import dataclasses

from engine.worker.input_batch import WorkerSequenceState


@dataclasses.dataclass(frozen=True)
class SampleRow:
    """One position to sample: the sequence, its drafts, how many of them precede this position,
    and the row of the step's hidden states that holds it."""

    state: WorkerSequenceState
    drafts: list[int]
    offset: int
    hidden_index: int

    @property
    def output_token_ids(self) -> list[int]:
        """The sequence's outputs as this position sees them: the drafts before it included."""
        return self.state.output_token_ids + self.drafts[: self.offset]


@dataclasses.dataclass(frozen=True)
class AcceptedTokens:
    """A sequence's tokens from one step, sampled at rows first_row .. first_row + len(tokens) - 1."""

    seq_id: str
    tokens: list[int]
    first_row: int


def sample_rows(
    states: list[WorkerSequenceState], last_indices: list[int], drafts: dict[str, list[int]]
) -> list[SampleRow]:
    """The rows to sample, in sequence order: one per sequence, or 1 + k for one with k drafts
    (its last k + 1 hidden states, `last_indices` being each sequence's last)."""
    rows = []
    for state, last in zip(states, last_indices, strict=True):
        seq_drafts = drafts.get(state.seq_id, [])
        first = last - len(seq_drafts)
        rows += [SampleRow(state, seq_drafts, j, first + j) for j in range(len(seq_drafts) + 1)]
    return rows


def accept_drafts(rows: list[SampleRow], sampled: list[int]) -> list[AcceptedTokens]:
    """Each sequence's tokens from the tokens sampled at its rows."""
    accepted = []
    index = 0
    while index < len(rows):
        row = rows[index]
        tokens = []
        for j in range(len(row.drafts) + 1):
            tokens.append(sampled[index + j])
            if j == len(row.drafts) or sampled[index + j] != row.drafts[j]:
                break
        accepted.append(AcceptedTokens(row.state.seq_id, tokens, index))
        index += len(row.drafts) + 1
    return accepted
