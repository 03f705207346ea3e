"""Speculative decoding with n-gram proposals on SmolLM2, against the same engine without it.

Greedy outputs must be token-identical, in float32 and (where bf16 matmuls sum a row alike at any
row count) bfloat16, with chunked prefill, prefix caching and preemption forced by a small cache;
seeded sampling with every sampling parameter too (each position draws from its own (seed,
position) generator, and the drafts accepted are the tokens sampled), with the same
log-probabilities; stop strings and max_tokens cut the output at the same token. Every block
returns to the pool. Requests that cannot take drafts (n > 1, a grammar) decode without them, with
the reason logged.
"""

from __future__ import annotations

import logging

import pytest
import torch

from engine import LLM, SamplingParams
from engine.sampling_params import StructuredOutputsParams
from kernels.linear import onednn_computes_in, panel_kernel_serves

pytestmark = pytest.mark.slow  # SmolLM2 with and without speculation, in two dtypes

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
PASSAGE = (
    "The quick brown fox jumps over the lazy dog. The dog sleeps under the old oak tree, "
    "and the fox runs back into the forest before the farmer wakes up."
)
CODE = "def area(width, height):\n    return width * height\n\n\ndef perimeter(width, height):\n"
PROMPTS = [
    f"Repeat this sentence exactly.\n{PASSAGE}\nRepeated:\n{PASSAGE[:20]}",
    f"Copy the code.\n{CODE}\nCopy:\n{CODE[:30]}",
    f"Repeat this sentence exactly.\n{PASSAGE}\nAgain:\n",  # shares the first prompt's prefix
    "List the numbers: one two three four one two three four one two",
]
# Chunked prefill (32 tokens a step) over 12 blocks of 16: four sequences of ~50 prompt and 40
# output tokens do not fit together, so some are preempted and recomputed.
TIGHT = {"num_kv_blocks": 12, "block_size": 16, "max_num_batched_tokens": 32, "max_num_seqs": 4}
# A bf16 row's projections are the same whether a step verifies 1 or 5 of its tokens only where
# each row is summed alike whatever the row count: raypage's panel kernel and oneDNN's bf16 matmul.
# Without AVX-512 BF16 the weights are widened to float32 for MKL's sgemm, whose summation order
# follows the row count; rounding those sums to bf16 then flips near ties (float32 keeps them).
BF16_ROWS_BATCH_INVARIANT = panel_kernel_serves() or onednn_computes_in(torch.bfloat16)
DTYPES = [
    "float32",
    pytest.param(
        "bfloat16",
        marks=pytest.mark.skipif(
            not BF16_ROWS_BATCH_INVARIANT,
            reason="bf16 matmuls sum rows in an order set by the row count here (no AVX-512 BF16)",
        ),
    ),
]


def generate(llm: LLM, params: SamplingParams | list[SamplingParams]):
    return [output.outputs[0] for output in llm.generate(PROMPTS, params, use_tqdm=False)]


@pytest.fixture(scope="module", params=DTYPES)
def engines(request):
    """(without speculation, with it) on the same tight cache, in one dtype. (In bfloat16 the
    tight cache's chunks and recomputes round differently from a roomy cache's single prefill, so
    the two engines must share the settings for their outputs to be comparable.)"""
    plain = LLM(dtype=request.param, **TIGHT)
    speculating = LLM(dtype=request.param, speculative_config=SPEC, **TIGHT)
    yield plain, speculating
    plain.llm_engine.shutdown()
    speculating.llm_engine.shutdown()


def scheduler_of(llm: LLM):
    return llm.llm_engine.engine_core.engine_core.scheduler


def test_greedy_outputs_are_those_without_speculation(engines):
    plain, speculating = engines
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    expected = [output.token_ids for output in generate(plain, params)]
    before = scheduler_of(speculating).num_preemptions
    assert [output.token_ids for output in generate(speculating, params)] == expected
    stats = speculating.get_stats()["spec_decode"]
    assert stats.num_accepted_tokens > 0.3 * stats.num_draft_tokens > 0
    assert scheduler_of(speculating).num_preemptions > before
    assert scheduler_of(speculating).prefix_cache_hits > 0
    kv = scheduler_of(speculating).kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks


def test_seeded_sampling_and_logprobs_are_those_without_speculation(engines):
    plain, speculating = engines
    params = [
        SamplingParams(
            temperature=0.7,
            top_p=0.9,
            top_k=40,
            min_p=0.02,
            seed=seed,
            repetition_penalty=1.1,
            presence_penalty=0.2,
            frequency_penalty=0.1,
            min_tokens=8,
            logit_bias={13: -2.0},
            max_tokens=24,
            logprobs=2,
        )
        for seed in range(len(PROMPTS))
    ]
    expected = generate(plain, params)
    got = generate(speculating, params)
    for want, have in zip(expected, got, strict=True):
        assert have.token_ids == want.token_ids
        for want_step, have_step in zip(want.logprobs, have.logprobs, strict=True):
            assert want_step.keys() == have_step.keys()
            for token, logprob in want_step.items():
                assert have_step[token].logprob == pytest.approx(logprob.logprob, abs=0.05)


def test_stop_strings_and_max_tokens_cut_at_the_same_token(engines):
    plain, speculating = engines
    params = SamplingParams(temperature=0.0, max_tokens=48, stop=["fox", "width"], ignore_eos=True)
    expected = generate(plain, params)
    for want, have in zip(expected, generate(speculating, params), strict=True):
        assert (have.text, have.token_ids, have.finish_reason) == (
            want.text,
            want.token_ids,
            want.finish_reason,
        )
    params = SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True)
    assert all(len(output.token_ids) == 7 for output in generate(speculating, params))


def test_requests_that_cannot_speculate_decode_without_it_and_say_why(engines, caplog):
    plain, speculating = engines
    choice = StructuredOutputsParams(choice=["fox", "dog", "oak tree"])
    requests = {
        "n > 1": SamplingParams(n=2, temperature=0.8, seed=1, max_tokens=16, ignore_eos=True),
        "structured output": SamplingParams(temperature=0.0, max_tokens=16, structured_outputs=choice),
    }
    for reason, params in requests.items():
        before = speculating.get_stats()["spec_decode"].num_drafts
        with caplog.at_level(logging.INFO, logger="engine.sched.speculation"):
            got = speculating.generate(PROMPTS[:1], params, use_tqdm=False)[0].outputs
        assert [o.token_ids for o in got] == [
            o.token_ids for o in plain.generate(PROMPTS[:1], params, use_tqdm=False)[0].outputs
        ]
        assert speculating.get_stats()["spec_decode"].num_drafts == before
        assert f"decodes without speculation: {reason}" in caplog.text
