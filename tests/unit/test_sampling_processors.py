"""Penalties, min_tokens, logit_bias and min_p against plain-Python references, and their order."""

from __future__ import annotations

import math

import pytest
import torch

from engine.sample.processors import apply_penalties
from engine.sampling_params import SamplingParams
from tests.unit.test_sampler import DRAWS, assert_follows, build, sample, softmax

ROW = [2.0, -1.0, 0.5, 1.5, 0.0, -0.5]


def penalized(logits, prompt, output, repetition=1.0, frequency=0.0, presence=0.0):
    """vLLM's penalties, one token at a time."""
    result = []
    for token, logit in enumerate(logits):
        if token in prompt or token in output:
            logit = logit / repetition if logit > 0 else logit * repetition
        count = output.count(token)
        logit -= frequency * count
        logit -= presence * (1 if count else 0)
        result.append(logit)
    return result


def argmax(values: list[float]) -> int:
    return max(range(len(values)), key=values.__getitem__)


@pytest.mark.parametrize(
    "penalties",
    [
        {"repetition_penalty": 2.0},
        {"repetition_penalty": 0.5},  # below 1 rewards repeats
        {"frequency_penalty": 0.3},
        {"presence_penalty": -0.7},
        {"repetition_penalty": 1.3, "frequency_penalty": 0.4, "presence_penalty": 1.1},
    ],
)
def test_penalties_match_the_reference(penalties):
    prompts = [[0, 1], [5], [2, 2, 4]]
    outputs = [[3, 3, 1], [], [0, 4, 4, 4]]
    params = [SamplingParams(**penalties), SamplingParams(), SamplingParams(**penalties)]
    meta = build(params, len(ROW), prompt=prompts, output=outputs)
    got = apply_penalties(torch.tensor([ROW] * 3), meta).tolist()
    reference = {
        "repetition": penalties.get("repetition_penalty", 1.0),
        "frequency": penalties.get("frequency_penalty", 0.0),
        "presence": penalties.get("presence_penalty", 0.0),
    }
    assert got[0] == pytest.approx(penalized(ROW, prompts[0], outputs[0], **reference))
    assert got[1] == pytest.approx(ROW)  # neutral row in the same batch
    assert got[2] == pytest.approx(penalized(ROW, prompts[2], outputs[2], **reference))


def test_frequency_and_presence_ignore_the_prompt():
    meta = build([SamplingParams(frequency_penalty=1.0, presence_penalty=1.0)], len(ROW), prompt=[[0, 0, 3]])
    assert apply_penalties(torch.tensor([ROW]), meta).tolist()[0] == pytest.approx(ROW)


def test_penalties_move_the_greedy_pick():
    logits = [1.0, 0.9, 0.8, -3.0]
    cases = [
        # Token 0 twice in the output: 1.0 - 2 * 0.1 = 0.8 < 0.9.
        (SamplingParams(temperature=0.0, frequency_penalty=0.1), [0, 0], 1),
        # Tokens 0 and 1 present: 1.0 - 0.25 and 0.9 - 0.25 fall below 0.8.
        (SamplingParams(temperature=0.0, presence_penalty=0.25), [0, 1], 2),
        # Tokens 0 and 1 seen: 1.0 / 1.3 and 0.9 / 1.3 fall below 0.8.
        (SamplingParams(temperature=0.0, repetition_penalty=1.3), [1, 0], 2),
    ]
    for params, output, want in cases:
        reference = penalized(
            logits, [], output, params.repetition_penalty, params.frequency_penalty, params.presence_penalty
        )
        assert argmax(reference) == want
        assert sample(torch.tensor([logits]), [params], output=[output]) == [want]


def test_repetition_penalty_pushes_negative_logits_further_down_through_sampling():
    logits = [0.0, -1.0, -1.0]
    params = SamplingParams(repetition_penalty=2.0)
    # Token 1 is in the prompt: -1 * 2 = -2, while token 2 keeps -1.
    tokens = sample(torch.tensor([logits] * DRAWS), [params] * DRAWS, seed=11, prompt=[[1]] * DRAWS)
    assert_follows(tokens, softmax(penalized(logits, [1], [], repetition=2.0)))


def test_penalties_apply_before_temperature():
    logits, output, temperature = [0.0, 0.0], [0, 0, 0, 0], 2.0
    params = SamplingParams(temperature=temperature, frequency_penalty=0.5)
    tokens = sample(torch.tensor([logits] * DRAWS), [params] * DRAWS, seed=12, output=[output] * DRAWS)
    expected = softmax([x / temperature for x in penalized(logits, [], output, frequency=0.5)])
    assert_follows(tokens, expected)  # p(0) = 1 / (1 + e) ~ 0.27
    penalty_after_temperature = softmax(
        [x / temperature - 0.5 * output.count(t) for t, x in enumerate(logits)]
    )
    assert abs(expected[0] - penalty_after_temperature[0]) > 0.1  # ~0.12: the order is observable


def test_min_tokens_holds_back_eos_and_stop_ids_until_reached():
    logits = torch.tensor([[5.0, 4.0, 1.0, 0.5]] * 5)  # EOS (0) and stop id 1 dominate
    held = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[1])
    params = [held] * 4 + [SamplingParams(temperature=0.0, stop_token_ids=[1])]
    outputs = [[], [9], [9, 9], [9, 9, 9], []]  # row 3 has reached min_tokens; row 4 has none
    assert sample(logits, params, output=outputs, eos=[0] * 5) == [2, 2, 2, 0, 0]


def test_min_tokens_without_an_eos_holds_back_only_the_stop_ids():
    params = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[0])
    assert sample(torch.tensor([[5.0, 4.0, 1.0]]), [params], eos=[None]) == [1]


def test_min_tokens_suppresses_every_draw_of_a_random_row():
    logits = torch.tensor([[3.0, 3.0, 0.0]] * 2000)
    params = SamplingParams(min_tokens=1, stop_token_ids=[1])
    tokens = sample(logits, [params] * 2000, seed=13, eos=[0] * 2000)
    assert set(tokens) == {2}


def test_logit_bias_forces_and_removes_tokens():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]] * 2000)
    forced = sample(logits, [SamplingParams(logit_bias={4: 100.0})] * 2000, seed=14)
    assert set(forced) == {4}
    removed = sample(logits, [SamplingParams(temperature=1.0, logit_bias={0: -100.0})] * 2000, seed=15)
    assert 0 not in removed
    assert sample(logits[:1], [SamplingParams(temperature=0.0, logit_bias={0: -100.0})]) == [1]


def test_logit_bias_shifts_the_distribution_by_its_value():
    row = [1.0, 0.0, 0.0]
    params = SamplingParams(logit_bias={1: 1.0, 2: -0.5})
    tokens = sample(torch.tensor([row] * DRAWS), [params] * DRAWS, seed=16)
    assert_follows(tokens, softmax([1.0, 1.0, -0.5]))


def test_logit_bias_applies_before_penalties():
    # Bias then repetition: (1 + 1) / 2 = 1.0 < 1.2. The other order would give 1 / 2 + 1 = 1.5.
    params = SamplingParams(temperature=0.0, logit_bias={0: 1.0}, repetition_penalty=2.0)
    assert sample(torch.tensor([[1.0, 1.2]]), [params], output=[[0]]) == [1]


def test_min_p_keeps_tokens_above_the_scaled_top_probability():
    row = [2.0, 1.0, 0.5, 0.0, -1.0]
    probs = softmax(row)
    kept = [p >= 0.2 * max(probs) for p in probs]  # e^-1.5 ~ 0.22 stays, e^-2 ~ 0.14 goes
    expected = softmax([x if keep else -math.inf for x, keep in zip(row, kept, strict=True)])
    tokens = sample(torch.tensor([row] * DRAWS), [SamplingParams(min_p=0.2)] * DRAWS, seed=17)
    assert kept == [True, True, True, False, False]
    assert_follows(tokens, expected)


def test_min_p_applies_after_temperature():
    row, temperature, min_p = [0.0, -1.0, -2.0], 2.0, 0.5
    tempered = softmax([x / temperature for x in row])  # ~[0.51, 0.31, 0.19]: token 1 stays
    assert [p >= min_p * max(tempered) for p in tempered] == [True, True, False]
    raw = softmax(row)  # ~[0.67, 0.24, 0.09]: token 1 would go
    assert [p >= min_p * max(raw) for p in raw] == [True, False, False]
    params = SamplingParams(temperature=temperature, min_p=min_p)
    tokens = sample(torch.tensor([row] * DRAWS), [params] * DRAWS, seed=18)
    assert_follows(tokens, softmax([row[0] / temperature, row[1] / temperature, -math.inf]))
