"""Greedy SmolLM2-135M-Instruct in float32 is token-identical to Hugging Face transformers,
whatever the batching: all prompts together, chunked prefill, preemption, shared prefixes,
a larger block size."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from tests.model.hf_reference import hf_greedy

pytestmark = pytest.mark.slow  # loads transformers' GGUF reference (about 20 s) and four engines

MAX_TOKENS = 24
PROMPTS = [
    "Hello",
    "The capital of France is",
    "Write a short poem about the ocean and the moon, in the style of a sea shanty.",
    "def fibonacci(n):",
    "Once upon a time, in a land far away, there lived a",
    "Q: What is the boiling point of water at sea level?\nA:",
    "List three primary colors:",
    "The quick brown fox jumps over the lazy dog. " * 6 + "Which animal jumped?",
]
SHARED_PREFIX = (
    "You are a helpful assistant for a school science club. Answer briefly and precisely, in plain "
    "words a twelve-year-old understands, citing no sources and using no lists, and keep every answer "
    "under twenty words. If a question is unclear, answer the most likely reading of it. "
    "Here is the question: "
)
PREFIX_PROMPTS = [
    SHARED_PREFIX + q for q in ("What is rain?", "Why is the sky blue?", "What is a prime number?")
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)


@pytest.fixture(scope="module")
def reference(hf_smollm2, hf_tokenizer):
    return {
        prompt: hf_greedy(hf_smollm2, hf_tokenizer(prompt).input_ids, MAX_TOKENS)
        for prompt in PROMPTS + PREFIX_PROMPTS
    }


def assert_matches(outputs, prompts, reference):
    for output, prompt in zip(outputs, prompts, strict=True):
        assert output.outputs[0].token_ids == reference[prompt], f"diverged on {prompt!r}"
        assert output.finished


@pytest.mark.parametrize(
    "settings",
    [
        pytest.param({}, id="batched"),
        pytest.param({"max_num_batched_tokens": 64, "max_num_seqs": 8}, id="chunked-prefill"),
        pytest.param({"block_size": 32}, id="block-size-32"),
    ],
)
def test_greedy_matches_transformers(settings, reference):
    llm = LLM(dtype="float32", num_kv_blocks=256, **settings)
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert_matches(outputs, PROMPTS, reference)
    stats = llm.get_stats()
    assert stats["num_running_reqs"] == stats["num_waiting_reqs"] == 0
    assert stats["kv_cache_usage"] == 0.0


def test_greedy_matches_transformers_under_preemption(reference):
    # 12 blocks of 16 tokens cannot hold all eight sequences at once: some are preempted and recomputed.
    llm = LLM(dtype="float32", num_kv_blocks=12)
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert_matches(outputs, PROMPTS, reference)
    stats = llm.get_stats()
    assert stats["num_preemptions"] > 0
    assert stats["kv_cache_usage"] == 0.0


def test_shared_prefix_is_served_from_cache(reference, hf_tokenizer):
    llm = LLM(dtype="float32", num_kv_blocks=256)
    outputs = llm.generate(PREFIX_PROMPTS, GREEDY, use_tqdm=False)
    assert_matches(outputs, PREFIX_PROMPTS, reference)
    prefix_blocks = len(hf_tokenizer(SHARED_PREFIX).input_ids) // 16
    assert prefix_blocks >= 3
    assert outputs[0].num_cached_tokens == 0
    for later in outputs[1:]:
        assert later.num_cached_tokens >= (prefix_blocks - 1) * 16
    stats = llm.get_stats()
    assert stats["prefix_cache_hits"] == sum(o.num_cached_tokens for o in outputs)


def test_engine_tokenizes_like_transformers(llm, hf_tokenizer):
    for prompt in PROMPTS:
        output = llm.generate(prompt, SamplingParams(max_tokens=1), use_tqdm=False)[0]
        assert output.prompt_token_ids == hf_tokenizer(prompt).input_ids
