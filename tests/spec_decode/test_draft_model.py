"""Speculative decoding with a draft model: the packaged SmolLM2 as the target, drafted by itself
(every draft should be accepted: a check of the draft's own paged cache through chunked prefill,
prefix hits and preemption) and by a tiny random Llama written at test time (few accepted); outputs
token-identical to the same engine without speculation, greedy and seeded. A draft whose vocabulary
or context does not fit the target is an error at start-up."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine.models.model_files import packaged_model_path
from tests.model.tiny_models import write_tiny_model
from tests.spec_decode.test_ngram_engine import PROMPTS, TIGHT

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
SEEDED = [
    SamplingParams(temperature=0.8, top_p=0.95, seed=seed, presence_penalty=0.3, max_tokens=24, logprobs=1)
    for seed in range(len(PROMPTS))
]


@pytest.fixture(scope="module")
def tiny_draft(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("draft") / "model")


@pytest.fixture(scope="module")
def expected():
    """Greedy and seeded outputs without speculation, on the same tight cache."""
    plain = LLM(dtype="float32", max_model_len=512, **TIGHT)
    outputs = [
        [output.outputs[0] for output in plain.generate(PROMPTS, params, use_tqdm=False)]
        for params in (GREEDY, SEEDED)
    ]
    plain.llm_engine.shutdown()
    return outputs


def speculating_llm(draft_path, k: int = 3) -> LLM:
    # max_model_len within the tiny draft's 512 positions.
    return LLM(
        dtype="float32",
        max_model_len=512,
        speculative_config={"model": str(draft_path), "num_speculative_tokens": k},
        **TIGHT,
    )


@pytest.mark.slow
@pytest.mark.parametrize("draft", ["self", "tiny"])
def test_draft_model_outputs_are_those_without_speculation(expected, tiny_draft, draft):
    llm = speculating_llm(packaged_model_path() if draft == "self" else tiny_draft)
    try:
        for params, want in zip((GREEDY, SEEDED), expected, strict=True):
            got = [output.outputs[0] for output in llm.generate(PROMPTS, params, use_tqdm=False)]
            assert [output.token_ids for output in got] == [output.token_ids for output in want]
        stats = llm.get_stats()["spec_decode"]
        assert stats.num_draft_tokens > 0
        if draft == "self":
            # Greedy drafts of the target itself: all accepted but at near ties.
            assert stats.num_accepted_tokens >= 0.6 * stats.num_draft_tokens
        scheduler = llm.llm_engine.engine_core.engine_core.scheduler
        assert scheduler.num_preemptions > 0 and scheduler.prefix_cache_hits > 0
        assert scheduler.kv_cache_manager.num_free_blocks == scheduler.kv_cache_manager.num_blocks
    finally:
        llm.llm_engine.shutdown()


def test_a_draft_that_does_not_fit_the_target_is_an_error(tmp_path):
    other_vocab = write_tiny_model(tmp_path / "vocab", vocab_size=1000)
    with pytest.raises(ValueError, match=r"vocabulary has 1000 tokens, the target's 49152"):
        speculating_llm(other_vocab)
    short = write_tiny_model(tmp_path / "short", max_position_embeddings=64)
    with pytest.raises(ValueError, match=r"holds 64 positions, fewer than max_model_len \(512\)"):
        speculating_llm(short)
