"""The batched sampler against hand-computed filters and the softmax distribution itself."""

from __future__ import annotations

import math

import pytest
import torch

from engine.sample.sampler import Sampler, SamplingMetadata, apply_top_k_top_p

LOGITS = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]])


def metadata(rows: int, temperature: float, top_k=None, top_p=None, generators=None) -> SamplingMetadata:
    return SamplingMetadata(
        temperature=torch.full((rows,), temperature),
        all_greedy=temperature < 1e-5,
        top_k=None if top_k is None else torch.full((rows,), top_k),
        top_p=None if top_p is None else torch.full((rows,), top_p),
        generators=generators or {},
    )


def kept(masked: torch.Tensor) -> set[int]:
    return set(torch.nonzero(torch.isfinite(masked[0])).flatten().tolist())


def test_top_k_keeps_the_k_largest():
    assert kept(apply_top_k_top_p(LOGITS.clone(), torch.tensor([2]), None)) == {0, 1}


def test_top_p_keeps_the_smallest_nucleus():
    probs = torch.softmax(LOGITS[0], 0).tolist()  # about [0.56, 0.21, 0.13, 0.08, 0.03]
    assert probs[0] < 0.6 < probs[0] + probs[1]
    assert kept(apply_top_k_top_p(LOGITS.clone(), None, torch.tensor([0.6]))) == {0, 1}
    assert kept(apply_top_k_top_p(LOGITS.clone(), None, torch.tensor([0.5]))) == {0}
    # The most likely token survives even the smallest p.
    assert kept(apply_top_k_top_p(LOGITS.clone(), None, torch.tensor([1e-6]))) == {0}


def test_greedy_takes_the_argmax():
    logits = torch.randn(4, 50)
    tokens = Sampler(torch.Generator().manual_seed(0))(logits, metadata(4, 0.0))
    assert tokens.tolist() == logits.argmax(dim=1).tolist()


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_sampling_follows_the_tempered_softmax(temperature):
    draws = 20000
    logits = LOGITS.expand(draws, -1).clone()
    tokens = Sampler(torch.Generator().manual_seed(1))(logits, metadata(draws, temperature))
    counts = torch.bincount(tokens, minlength=5).double() / draws
    expected = [math.exp(x / temperature) for x in LOGITS[0].tolist()]
    expected = [e / sum(expected) for e in expected]
    for observed, want in zip(counts.tolist(), expected, strict=True):
        assert abs(observed - want) < 4 * math.sqrt(want * (1 - want) / draws) + 1e-3


def test_top_k_sampling_never_leaves_the_top_k():
    logits = LOGITS.expand(2000, -1).clone()
    tokens = Sampler(torch.Generator().manual_seed(2))(logits, metadata(2000, 1.0, top_k=torch.tensor(2)))
    assert set(tokens.tolist()) == {0, 1}


def test_seeded_row_does_not_depend_on_the_rest_of_the_batch():
    def draw(batch_logits, row):
        generator = torch.Generator().manual_seed(1234)
        meta = metadata(batch_logits.shape[0], 1.0, generators={row: generator})
        return Sampler(torch.Generator().manual_seed(row + 7))(batch_logits, meta)[row].item()

    logits = torch.randn(1, 1000)
    alone = [draw(logits, 0) for _ in range(3)]
    crowded = draw(torch.cat([torch.randn(3, 1000), logits]), 3)
    assert alone == [alone[0]] * 3
    assert crowded == alone[0]
