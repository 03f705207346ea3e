"""kv_cache_dtype="int8" through the engine: SmolLM2's greedy picks over an int8 cache against the bf16
cache's, the cache's layout and size, shared prefixes, copy-on-write and swap preemption over int8
blocks with nothing leaked, and the error where an int8 cache cannot run."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, BeamSearchParams, SamplingParams
from engine.worker.cache_engine import CacheEngine, resolve_kv_cache_dtype
from kernels.attention import get_attention_backend, selector
from kernels.build import cpu_kernels_available
from tests.model.tiny_models import write_tiny_model

needs_kernels = pytest.mark.skipif(
    not cpu_kernels_available(), reason="the C++ CPU kernels could not be built here (no compiler or ninja)"
)

PROMPTS = [
    "Write one sentence about the history of the printing press in Europe",
    "List some animals:",
    "Tell me about rivers and mountains, briefly.",
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
# Log-probability gap within which two tokens are a near tie: the logits are bf16, whose steps at
# SmolLM2's logit sizes are 1/16, and the int8 rows move the scores by a few of them.
NEAR_TIE = 0.5


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    return str(write_tiny_model(tmp_path_factory.mktemp("tiny") / "model"))


def scheduler_of(llm: LLM):
    return llm.llm_engine.engine_core.engine_core.scheduler


def assert_no_block_held(llm: LLM) -> None:
    kv = scheduler_of(llm).kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks
    if kv.cpu_pool is not None:
        assert kv.cpu_pool.num_free_blocks == kv.cpu_pool.num_blocks


@needs_kernels
def test_int8_kv_against_bf16_kv():
    """Each token SmolLM2 (bf16) picks over an int8 cache against the bf16 cache's pick after the same
    tokens (read from the bf16 engine's prompt log-probabilities over the int8 engine's sequences):
    98% agree here; any other pick is a near tie of the bf16 cache's best."""
    int8 = LLM(dtype="bfloat16", kv_cache_dtype="int8", num_kv_blocks=64)
    try:
        # head_dim 64: rows of 64 int8 values and a 4-byte scale.
        assert {shape[-1] for shape in int8.collective_rpc("kv_cache_shapes")[0].values()} == {68}
        outputs = int8.generate(PROMPTS, GREEDY, use_tqdm=False)
    finally:
        int8.llm_engine.shutdown()
    sequences = [list(o.prompt_token_ids) + list(o.outputs[0].token_ids) for o in outputs]
    bf16 = LLM(dtype="bfloat16", num_kv_blocks=64)
    try:
        teacher_forced = bf16.generate(
            [{"prompt_token_ids": ids} for ids in sequences],
            SamplingParams(max_tokens=1, prompt_logprobs=5, temperature=0.0),
            use_tqdm=False,
        )
    finally:
        bf16.llm_engine.shutdown()
    agree, picks = 0, 0
    for output, forced in zip(outputs, teacher_forced, strict=True):
        start = len(output.prompt_token_ids)
        for offset, token in enumerate(output.outputs[0].token_ids):
            position = forced.prompt_logprobs[start + offset]
            best = min(position, key=lambda candidate: position[candidate].rank)
            picks += 1
            if token == best:
                agree += 1
                continue
            assert token in position, f"int8 picked {token}, outside the bf16 cache's top 5"
            assert position[best].logprob - position[token].logprob <= NEAR_TIE
    assert agree / picks >= 0.95, f"{agree} of {picks} picks agree"


@needs_kernels
def test_the_same_memory_holds_about_twice_the_blocks(tiny_model):
    # The tiny model: 2 layers of 2 KV heads of head_dim 16. A block of 16 tokens holds a key and a
    # value row per token, head and layer: 16 values of 2 bytes in bf16, 16 bytes and a 4-byte scale in int8.
    spec = {0: (2, 16), 1: (2, 16)}
    bf16_block, int8_block = 2 * 2 * 16 * 2 * 16 * 2, 2 * 2 * 16 * 2 * (16 + 4)
    assert CacheEngine.bytes_per_block(16, spec, torch.bfloat16) == bf16_block
    assert CacheEngine.bytes_per_block(16, spec, torch.int8) == int8_block
    blocks = {}
    for kv_cache_dtype in ("auto", "int8"):
        llm = LLM(tiny_model, dtype="bfloat16", kv_cache_dtype=kv_cache_dtype, kv_cache_memory="1MiB")
        blocks[kv_cache_dtype] = scheduler_of(llm).kv_cache_manager.num_blocks
        llm.llm_engine.shutdown()
    assert blocks == {"auto": 2**20 // bf16_block, "int8": 2**20 // int8_block}


@needs_kernels
def test_shared_prefixes_over_int8_blocks_give_each_request_its_output_alone(tiny_model):
    prefix = " ".join(["The printing press spread across Europe within a few decades."] * 8)
    prompts = [prefix + " Its first effect was", prefix + " Scholars soon found that"]
    alone = LLM(
        tiny_model, dtype="float32", kv_cache_dtype="int8", num_kv_blocks=64, enable_prefix_caching=False
    )
    expected = [alone.generate(p, GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    alone.llm_engine.shutdown()
    shared = LLM(tiny_model, dtype="float32", kv_cache_dtype="int8", num_kv_blocks=64)
    try:
        first = shared.generate(prompts[0], GREEDY, use_tqdm=False)[0]
        together = shared.generate(prompts, GREEDY, use_tqdm=False)
        assert first.num_cached_tokens == 0
        assert all(output.num_cached_tokens >= 64 for output in together)  # the prefix's full blocks
        assert [first.outputs[0].token_ids] + [o.outputs[0].token_ids for o in together] == [
            expected[0],
            *expected,
        ]
        assert_no_block_held(shared)
    finally:
        shared.llm_engine.shutdown()


@needs_kernels
def test_forks_and_swap_preemption_over_int8_blocks_keep_outputs_and_free_every_block(
    tiny_model, monkeypatch
):
    """Parallel samples fork the prompt's blocks (copy-on-write of the partial one) and, with too few
    blocks, groups are swapped to the host pool and back: the int8 rows and their scales travel
    with their blocks, so the outputs are those of an engine with room for everything.

    The logits of the two engines can still differ in their last bits late in a sequence (1e-6 in a
    logprob: different batches, one float32 rounding turned into one int8 step), and the random
    model's flat distribution puts 49,152 tokens of probability near 1e-5 side by side in the
    inverse CDF, where such a difference moves a draw to the next token id. Draws among the top 50
    tokens, each holding about 2% of what the filter keeps, stay where they are."""
    seeded = SamplingParams(
        n=4, temperature=1.0, top_p=0.95, top_k=50, seed=11, max_tokens=20, ignore_eos=True
    )
    params = [
        seeded,
        SamplingParams(n=3, temperature=0.8, top_k=50, seed=5, max_tokens=24, ignore_eos=True),
        seeded,
    ]
    beams = BeamSearchParams(beam_width=3, max_tokens=12)
    settings = dict(dtype="float32", kv_cache_dtype="int8", block_size=16)
    roomy = LLM(tiny_model, num_kv_blocks=256, **settings)
    expected = [[c.token_ids for c in o.outputs] for o in roomy.generate(PROMPTS, params, use_tqdm=False)]
    expected_beams = [s.tokens for s in roomy.beam_search(PROMPTS[1], beams)[0].sequences]
    roomy.llm_engine.shutdown()
    tight = LLM(tiny_model, num_kv_blocks=14, swap_space=0.01, **settings)
    try:
        scheduler = scheduler_of(tight)
        schedule, swapped_out = scheduler.schedule, []

        def recording():
            scheduled = schedule()
            swapped_out.extend(scheduled.scheduler_output.blocks_to_swap_out)
            return scheduled

        monkeypatch.setattr(scheduler, "schedule", recording)
        got = [[c.token_ids for c in o.outputs] for o in tight.generate(PROMPTS, params, use_tqdm=False)]
        assert got == expected
        assert [s.tokens for s in tight.beam_search(PROMPTS[1], beams)[0].sequences] == expected_beams
        assert swapped_out, "nothing was swapped: the test lost its pressure"
        assert_no_block_held(tight)
    finally:
        tight.llm_engine.shutdown()


@needs_kernels
def test_a_draft_model_speculates_over_its_own_int8_cache(tiny_model):
    """The tiny model drafting for itself, both caches int8: the greedy tokens of no speculation,
    most drafts accepted (each verification attends k + 1 rows of a sequence at once)."""
    settings = dict(dtype="float32", kv_cache_dtype="int8", num_kv_blocks=64, max_model_len=512)
    plain = LLM(tiny_model, **settings)
    expected = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, GREEDY, use_tqdm=False)]
    plain.llm_engine.shutdown()
    draft = {"model": tiny_model, "num_speculative_tokens": 3}
    speculating = LLM(tiny_model, speculative_config=draft, **settings)
    try:
        got = [o.outputs[0].token_ids for o in speculating.generate(PROMPTS, GREEDY, use_tqdm=False)]
        assert got == expected
        stats = speculating.get_stats()["spec_decode"]
        assert stats.num_accepted_tokens >= 0.6 * stats.num_draft_tokens > 0
        assert_no_block_held(speculating)
    finally:
        speculating.llm_engine.shutdown()


def test_int8_on_cuda_or_without_the_kernels_is_an_error_naming_the_setting(monkeypatch):
    cuda = torch.device("cuda")
    with pytest.raises(ValueError, match=r"kv_cache_dtype='int8' needs .* on cuda attention runs in sdpa"):
        resolve_kv_cache_dtype("int8", torch.bfloat16, get_attention_backend("torch", cuda), cuda)
    monkeypatch.setattr(selector, "cpu_kernels_available", lambda: False)  # cpu_paged falls back to sdpa
    cpu = torch.device("cpu")
    with pytest.raises(ValueError, match=r"kv_cache_dtype='int8' needs .* on cpu attention runs in sdpa"):
        resolve_kv_cache_dtype("int8", torch.bfloat16, get_attention_backend("cpu_paged", cpu), cpu)
    assert (
        resolve_kv_cache_dtype("auto", torch.bfloat16, get_attention_backend("sdpa", cpu), cpu)
        == torch.bfloat16
    )


@pytest.mark.parametrize(
    "settings",
    [{"attention_backend": "sdpa"}, {"attention_backend": "reference"}],
    ids=["sdpa", "reference"],
)
def test_int8_where_it_cannot_run_is_an_error_naming_the_setting(tiny_model, settings):
    with pytest.raises(ValueError, match="kv_cache_dtype='int8' needs the cpu_paged attention backend"):
        LLM(tiny_model, dtype="float32", kv_cache_dtype="int8", num_kv_blocks=16, **settings)
