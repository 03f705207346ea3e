"""The batched sampler against hand-computed filters and the softmax distribution itself.

Distribution checks sample many identical rows in one batch and compare the frequencies with a
plain-Python reference distribution.
"""

from __future__ import annotations

import math

import pytest
import torch

from engine.sample.metadata import SamplingMetadata, build_sampling_metadata, sampling_values
from engine.sample.sampler import Sampler, apply_top_k_top_p, greedy_tokens
from engine.sampling_params import SamplingParams
from kernels.build import cpu_kernels_available

LOGITS = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]])
DRAWS = 20000


def build(
    params: list[SamplingParams],
    vocab: int,
    prompt: list[list[int]] | None = None,
    output: list[list[int]] | None = None,
    eos: list[int | None] | None = None,
    seeds: list[int | None] | None = None,
) -> SamplingMetadata:
    """build_sampling_metadata on CPU, with empty token histories, no EOS and no seeds by default."""
    rows = len(params)
    return build_sampling_metadata(
        params,
        sampling_values(params, vocab, torch.device("cpu")),
        prompt if prompt is not None else [[] for _ in range(rows)],
        output if output is not None else [[] for _ in range(rows)],
        seeds if seeds is not None else [None] * rows,
        eos if eos is not None else [None] * rows,
    )


def sample(logits: torch.Tensor, params: list[SamplingParams], seed: int = 0, **history) -> list[int]:
    """The tokens the sampler draws for `logits` under `params` (history: see `build`)."""
    meta = build(params, logits.shape[1], **history)
    return Sampler(torch.Generator().manual_seed(seed))(logits, meta).sampled_token_ids.tolist()


def softmax(logits: list[float]) -> list[float]:
    """Plain-Python softmax; -inf logits get probability 0."""
    top = max(logits)
    weights = [math.exp(x - top) for x in logits]
    return [w / sum(weights) for w in weights]


def assert_follows(tokens: list[int], probs: list[float]) -> None:
    """The frequencies of `tokens` match `probs` within four standard errors."""
    for token, want in enumerate(probs):
        observed = tokens.count(token) / len(tokens)
        assert abs(observed - want) < 4 * math.sqrt(want * (1 - want) / len(tokens)) + 1e-3, (
            token,
            observed,
            want,
        )


def kept(masked: torch.Tensor) -> set[int]:
    return set(torch.nonzero(torch.isfinite(masked[0])).flatten().tolist())


def test_top_k_keeps_the_k_largest():
    assert kept(apply_top_k_top_p(LOGITS.clone(), torch.tensor([2]), None)) == {0, 1}


def test_top_p_keeps_the_smallest_nucleus():
    probs = softmax(LOGITS[0].tolist())  # about [0.56, 0.21, 0.13, 0.08, 0.03]
    assert probs[0] < 0.6 < probs[0] + probs[1]
    assert kept(apply_top_k_top_p(LOGITS.clone(), None, torch.tensor([0.6]))) == {0, 1}
    assert kept(apply_top_k_top_p(LOGITS.clone(), None, torch.tensor([0.5]))) == {0}
    # The most likely token survives even the smallest p.
    assert kept(apply_top_k_top_p(LOGITS.clone(), None, torch.tensor([1e-6]))) == {0}


def test_greedy_takes_the_argmax():
    logits = torch.randn(4, 50)
    output = Sampler(torch.Generator().manual_seed(0))(
        logits, build([SamplingParams(temperature=0.0)] * 4, 50)
    )
    assert output.sampled_token_ids.tolist() == [
        max(range(50), key=row.__getitem__) for row in logits.tolist()
    ]
    assert output.sampled_token_ids.dtype == torch.int64
    assert output.logprobs is None


def test_greedy_on_bf16_logits_takes_the_first_largest_even_among_ties():
    logits = torch.tensor([[0.5, 2.0, 2.0, -1.0], [3.0, 1.0, 3.0, 3.0], [-2.0, -2.5, -1.0, -1.5]])
    expected = [max(range(4), key=lambda i, row=row: (row[i], -i)) for row in logits.tolist()]
    assert sample(logits.bfloat16(), [SamplingParams(temperature=0.0)] * 3) == expected == [1, 0, 2]


def _first_largest(row: list[float]) -> int:
    """The plain-Python greedy choice: the first NaN if any (torch's argmax takes NaN as largest),
    else the first of the largest values."""
    nans = [i for i, value in enumerate(row) if math.isnan(value)]
    return nans[0] if nans else max(range(len(row)), key=lambda i: (row[i], -i))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("threads", [1, 2])
def test_greedy_tokens_take_the_first_largest_at_vocabulary_scale(dtype, threads):
    """The CPU's `max(dim).indices` path, on full-size rows with many ties, an all -inf row and NaNs."""
    generator = torch.Generator().manual_seed(0)
    logits = torch.randint(-3, 4, (9, 49152), generator=generator).to(dtype)  # about 7,000 ties per row
    logits[1] = float("-inf")
    logits[2, [17, 30000]] = float("nan")
    logits[3] = 1.0
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        tokens = greedy_tokens(logits)
        mixed = sample(logits, [SamplingParams(temperature=0.0)] * 8 + [SamplingParams(temperature=1.0)])
    finally:
        torch.set_num_threads(saved)
    expected = [_first_largest(row) for row in logits.float().tolist()]
    assert tokens.tolist() == expected
    assert mixed[:8] == expected[:8]  # greedy rows beside a random one take the processed path


@pytest.mark.skipif(not cpu_kernels_available(), reason="the C++ CPU kernels could not be built here")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("vocab", [49152, 49157])
def test_the_argmax_kernel_takes_the_first_largest_in_every_lane_and_tail(dtype, vocab):
    """torch.ops.raypage.argmax_rows on full-size rows of distinct values whose maximum sits at
    chosen places (the first column, a vector's last lane, the last column, the row's odd tail),
    a NaN after the maximum and one in the last column, -0 tying +0, and rows 2 x vocab apart
    (a view into wider logits)."""
    generator = torch.Generator().manual_seed(vocab)
    wide = (torch.rand(12, 2 * vocab, generator=generator) - 2).to(dtype)  # all negative: 0 is the peak
    logits = wide[:, :vocab]
    for row, column in enumerate([0, 15, 16, 31, 4095, vocab - 1, vocab - 3]):
        logits[row, column] = 0.5
    logits[7, 100], logits[7, 90] = float("nan"), 0.5
    logits[8, vocab - 1] = float("nan")
    logits[9, [40, 41]] = torch.tensor([-0.0, 0.0], dtype=dtype)
    logits[10, [41, 40]] = torch.tensor([-0.0, 0.0], dtype=dtype)
    logits[11] = float("-inf")
    expected = [_first_largest(row) for row in logits.float().tolist()]
    assert expected[:9] == [0, 15, 16, 31, 4095, vocab - 1, vocab - 3, 100, vocab - 1]
    for threads in (1, 2):
        saved = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            assert torch.ops.raypage.argmax_rows(logits).tolist() == expected
            assert greedy_tokens(logits).tolist() == expected
        finally:
            torch.set_num_threads(saved)


def test_sampling_does_not_modify_the_callers_logits():
    logits = LOGITS.expand(3, -1).clone()
    params = SamplingParams(temperature=0.7, min_p=0.1, top_k=3, logit_bias={0: -5.0}, repetition_penalty=1.5)
    sample(logits, [params] * 3, output=[[0, 1]] * 3)
    assert torch.equal(logits, LOGITS.expand(3, -1))


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_sampling_follows_the_tempered_softmax(temperature):
    tokens = sample(LOGITS.expand(DRAWS, -1), [SamplingParams(temperature=temperature)] * DRAWS, seed=1)
    assert_follows(tokens, softmax([x / temperature for x in LOGITS[0].tolist()]))


def test_top_k_sampling_never_leaves_the_top_k():
    tokens = sample(LOGITS.expand(2000, -1), [SamplingParams(top_k=2)] * 2000, seed=2)
    assert set(tokens) == {0, 1}


def test_rows_with_different_settings_follow_their_own_distributions():
    groups = [
        (SamplingParams(temperature=0.5), softmax([x / 0.5 for x in LOGITS[0].tolist()])),
        # top_k=2 renormalizes the two largest logits.
        (SamplingParams(temperature=1.0, top_k=2), softmax(LOGITS[0].tolist()[:2]) + [0.0] * 3),
        # Token 3 forced by its bias.
        (SamplingParams(temperature=1.5, logit_bias={3: 100.0}), [0.0, 0.0, 0.0, 1.0, 0.0]),
        (SamplingParams(temperature=0.0), [1.0, 0.0, 0.0, 0.0, 0.0]),
    ]
    per_group = 5000
    # Interleaved, so that each group's rows are spread across the batch.
    params = [groups[row % len(groups)][0] for row in range(per_group * len(groups))]
    tokens = sample(LOGITS.expand(len(params), -1), params, seed=3)
    for index, (_, probs) in enumerate(groups):
        assert_follows(tokens[index :: len(groups)], probs)


def test_greedy_rows_are_unaffected_by_random_rows_in_the_batch():
    logits = torch.randn(6, 40, generator=torch.Generator().manual_seed(4))
    greedy, hot = SamplingParams(temperature=0.0), SamplingParams(temperature=5.0, top_p=0.5, min_p=0.01)
    mixed = sample(logits, [greedy, hot, greedy, hot, hot, greedy], seed=5)
    alone = sample(logits, [greedy] * 6)
    argmax = [max(range(40), key=row.__getitem__) for row in logits.tolist()]
    assert (
        [mixed[row] for row in (0, 2, 5)]
        == [argmax[row] for row in (0, 2, 5)]
        == [alone[r] for r in (0, 2, 5)]
    )


def test_seeded_row_does_not_depend_on_the_rest_of_the_batch():
    def draw(batch_logits, row, params):
        seeds = [None] * batch_logits.shape[0]
        seeds[row] = 1234
        return sample(batch_logits, params, seed=row + 7, seeds=seeds)[row]

    logits = torch.randn(1, 1000)
    alone = [draw(logits, 0, [SamplingParams(seed=1234)]) for _ in range(3)]
    # Neighbours with other settings (penalties, logprobs, filters) change nothing for the seeded row.
    neighbours = [
        SamplingParams(temperature=0.0),
        SamplingParams(top_k=5, logprobs=3, repetition_penalty=1.3),
        SamplingParams(min_p=0.2, frequency_penalty=0.5),
    ]
    crowded = draw(torch.cat([torch.randn(3, 1000), logits]), 3, [*neighbours, SamplingParams(seed=1234)])
    assert alone == [alone[0]] * 3
    assert crowded == alone[0]


def test_build_sampling_metadata_derives_every_field():
    params = [
        SamplingParams(temperature=0.0, seed=9, logprobs=1),
        SamplingParams(top_k=-1, top_p=0.9, min_tokens=2, stop_token_ids=[7], logit_bias={3: 1.5}),
        SamplingParams(top_k=3, presence_penalty=0.5, min_tokens=1, logprobs=4),
        SamplingParams(top_k=99, repetition_penalty=1.2, min_tokens=5, seed=1),
    ]
    meta = build(
        params, vocab=10, output=[[], [1], [2], [3]], eos=[0, 0, 0, None], seeds=[5, None, None, 2**64 - 1]
    )
    assert meta.temperature.tolist() == [0.0, 1.0, 1.0, 1.0]
    assert not meta.all_greedy
    assert meta.top_k.tolist() == [10, 10, 3, 10]  # 0, -1 and beyond-vocab all mean "off"
    assert meta.top_p.tolist() == pytest.approx([1.0, 0.9, 1.0, 1.0])
    assert meta.min_p is None
    # The greedy row never draws; the key's 64 bits as an int64 holds them.
    assert meta.seeded.tolist() == [False, False, False, True] and meta.seed_keys.tolist() == [0, 0, 0, -1]
    assert meta.presence_penalties.tolist() == [0.0, 0.0, 0.5, 0.0]
    assert meta.frequency_penalties is None
    assert meta.repetition_penalties.tolist() == pytest.approx([1.0, 1.0, 1.0, 1.2])
    # Row 2 has reached its min_tokens; row 3 has no EOS and no stop ids, so nothing to suppress.
    assert meta.min_tokens == {1: frozenset({0, 7})}
    assert meta.logit_bias == {1: {3: 1.5}}
    assert meta.max_num_logprobs == 4


def test_build_sampling_metadata_leaves_out_what_no_row_needs():
    meta = build([SamplingParams(temperature=0.0, top_k=5), SamplingParams(temperature=0.0)], vocab=10)
    assert meta.all_greedy
    assert meta.top_k is meta.top_p is meta.min_p is None
    assert meta.presence_penalties is meta.frequency_penalties is meta.repetition_penalties is None
    assert meta.min_tokens == {} and meta.logit_bias == {} and meta.seed_keys is meta.seeded is None
    assert meta.max_num_logprobs is None
