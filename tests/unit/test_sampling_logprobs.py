"""Sample logprobs and compute_logprobs against a plain-Python log-softmax of the raw logits."""

from __future__ import annotations

import math

import pytest
import torch

from engine.sample.sampler import Sampler, compute_logprobs
from engine.sampling_params import SamplingParams
from tests.unit.test_sampler import build

ROWS = [
    [1.0, 3.0, -2.0, 0.5, 2.5, 0.0],
    [0.0, 0.0, 4.0, -1.0, 1.0, 2.0],
    [-1.0, 2.0, 1.0, 0.0, 3.5, 1.5],
]
TIED = [-1.0, 2.0, 2.0, 0.0, 3.5, 1.5]  # tokens 1 and 2 tie: neither pushes the other's rank down


def log_softmax(row: list[float]) -> list[float]:
    log_total = math.log(sum(math.exp(x) for x in row))
    return [x - log_total for x in row]


def top(row: list[float], k: int) -> list[int]:
    return sorted(range(len(row)), key=lambda token: -row[token])[:k]


def rank(row: list[float], token: int) -> int:
    return 1 + sum(1 for x in row if x > row[token])


def check_row(
    ids: list[int], values: list[float], got_rank: int, raw: list[float], token: int, k: int
) -> None:
    """Column 0 is `token`, then the top k; values are the raw log-softmax; the rank is `token`'s."""
    reference = log_softmax(raw)
    assert ids == [token, *top(raw, k)]
    assert values == pytest.approx([reference[t] for t in ids], abs=1e-5)
    assert got_rank == rank(raw, token)


def test_sample_logprobs_are_of_the_raw_logits():
    # Every processing step is on, and none of it may reach the logprobs.
    params = [
        SamplingParams(logprobs=2, temperature=0.3, repetition_penalty=1.7, logit_bias={0: 4.0}),
        SamplingParams(logprobs=1, temperature=0.0, frequency_penalty=1.0, min_tokens=4),
        SamplingParams(logprobs=3, top_k=2, min_p=0.1, presence_penalty=0.5),
    ]
    meta = build(params, 6, prompt=[[1], [2], [4]], output=[[1, 4], [2, 2], [4]], eos=[None, 2, None])
    output = Sampler(torch.Generator().manual_seed(0))(torch.tensor(ROWS), meta)
    sampled = output.sampled_token_ids.tolist()
    ids, values, ranks = output.logprobs.tolists()
    assert output.logprobs.token_ids.dtype == output.logprobs.ranks.dtype == torch.int64
    assert output.logprobs.logprobs.dtype == torch.float32
    for row in range(3):
        # k is the batch's largest request (3), so every row has 1 + 3 columns.
        check_row(ids[row], values[row], ranks[row], ROWS[row], sampled[row], 3)
    # Row 1 is greedy on processed logits: EOS (2) held back, so not the raw argmax.
    assert sampled[1] == 5 and ranks[1] == 2


def test_rank_counts_only_strictly_greater_logprobs():
    meta = build([SamplingParams(temperature=0.0, logprobs=0)], 6)
    output = Sampler(torch.Generator())(torch.tensor([TIED]), meta)
    ids, values, ranks = output.logprobs.tolists()
    assert ids == [[4]] and ranks == [1]  # logprobs=0: the sampled token alone
    assert values[0] == pytest.approx([log_softmax(TIED)[4]], abs=1e-5)
    given = compute_logprobs(torch.tensor([TIED, TIED]), torch.tensor([1, 2]), 1)
    assert given.ranks.tolist() == [2, 2]


def test_no_logprobs_when_no_row_asks():
    meta = build([SamplingParams(temperature=0.5), SamplingParams(temperature=0.0)], 6)
    assert Sampler(torch.Generator())(torch.tensor(ROWS[:2]), meta).logprobs is None


def test_compute_logprobs_for_given_tokens():
    tokens = [2, 3, 0]  # none of them the top token of its row
    # bfloat16 logits (these values are exact in it) come back as float32 logprobs.
    got = compute_logprobs(torch.tensor(ROWS, dtype=torch.bfloat16), torch.tensor(tokens), 2)
    assert got.logprobs.dtype == torch.float32
    ids, values, ranks = got.tolists()
    for row, token in enumerate(tokens):
        check_row(ids[row], values[row], ranks[row], ROWS[row], token, 2)
