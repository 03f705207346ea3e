"""The offline API's behaviour: inputs, outputs, stops, aborts, stats, configs."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine import LLM, BeamSearchParams, EngineConfig, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=12)


@pytest.fixture(scope="module")
def llm():
    return LLM(dtype="float32", num_kv_blocks=128)


def test_prompt_forms_and_input_order(llm):
    ids = llm.get_tokenizer()("The capital of France is").input_ids
    outputs = llm.generate(
        ["The capital of France is", {"prompt_token_ids": ids}, {"prompt": "Hello"}], GREEDY, use_tqdm=False
    )
    assert [o.prompt for o in outputs] == ["The capital of France is", None, "Hello"]
    assert outputs[0].prompt_token_ids == outputs[1].prompt_token_ids == ids
    assert outputs[0].outputs[0].token_ids == outputs[1].outputs[0].token_ids
    assert all(o.finished for o in outputs)
    single = llm.generate("The capital of France is", GREEDY, use_tqdm=False)
    assert single[0].outputs[0].text == outputs[0].outputs[0].text


def test_text_matches_a_full_decode(llm):
    tokenizer = llm.get_tokenizer()
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=40)
    for output in llm.generate(["Write a list of fruits:", "Tell me a joke."], params, use_tqdm=False):
        completion = output.outputs[0]
        assert completion.text == tokenizer.decode(completion.token_ids, skip_special_tokens=True)


def test_max_tokens_and_eos_stops(llm):
    length = llm.generate("Count: 1, 2, 3,", SamplingParams(temperature=0.0, max_tokens=5), use_tqdm=False)[0]
    assert len(length.outputs[0].token_ids) == 5
    assert length.outputs[0].finish_reason == "length"
    chat = llm.chat(
        [{"role": "user", "content": "Say hi."}],
        SamplingParams(temperature=0.0, max_tokens=200),
        use_tqdm=False,
    )
    completion = chat[0].outputs[0]
    assert completion.finish_reason == "stop" and completion.stop_reason is None
    assert completion.token_ids[-1] == llm.get_tokenizer().eos_token_id
    assert "<|im_end|>" not in completion.text


def test_stop_token_ids_report_the_token(llm):
    first = llm.generate("Count: 1, 2, 3,", GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    stopped = llm.generate(
        "Count: 1, 2, 3,",
        SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[first[2]]),
        use_tqdm=False,
    )[0].outputs[0]
    assert stopped.token_ids == first[:3]
    assert (stopped.finish_reason, stopped.stop_reason) == ("stop", first[2])


def test_seeded_sampling_is_reproducible_and_unseeded_varies(llm):
    seeded = SamplingParams(temperature=1.0, top_p=0.9, top_k=40, seed=7, max_tokens=16)
    first = llm.generate(["Once upon a time"], seeded, use_tqdm=False)[0].outputs[0].token_ids
    crowd = ["Once upon a time", "Other prompt", "Yet another one"]
    again = llm.generate(
        crowd, [seeded, SamplingParams(temperature=1.0), SamplingParams(temperature=1.0)], use_tqdm=False
    )
    assert again[0].outputs[0].token_ids == first
    free = SamplingParams(temperature=1.5, max_tokens=16)
    texts = {
        tuple(o.outputs[0].token_ids) for o in llm.generate(["Once upon a time"] * 4, free, use_tqdm=False)
    }
    assert len(texts) > 1


def test_prompt_larger_than_the_cache_is_ignored_with_an_error():
    small = LLM(dtype="float32", num_kv_blocks=4, block_size=16)
    outputs = small.generate(
        [{"prompt_token_ids": [100] * 80}, "Hi"],
        SamplingParams(temperature=0.0, max_tokens=4),
        use_tqdm=False,
    )
    ignored, served = outputs
    assert ignored.finished and ignored.outputs[0].token_ids == []
    assert ignored.outputs[0].finish_reason == "length"
    assert "does not fit the KV cache" in ignored.error
    assert len(served.outputs[0].token_ids) == 4
    assert small.get_stats()["kv_cache_usage"] == 0.0


def test_request_that_outgrows_the_cache_is_cut_by_length():
    small = LLM(dtype="float32", num_kv_blocks=2, block_size=16)
    output = small.generate(
        "Tell me a long story.", SamplingParams(max_tokens=100, ignore_eos=True), use_tqdm=False
    )[0]
    assert output.outputs[0].finish_reason == "length"
    assert len(output.prompt_token_ids) + len(output.outputs[0].token_ids) == 32


def test_abort_frees_blocks_and_others_continue(llm):
    engine = llm.llm_engine
    long_params = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)
    engine.add_request("keep", "Tell me about the sea.", long_params)
    engine.add_request("drop", "Tell me about the sky.", long_params)
    for _ in range(3):
        engine.step()
    used_by_both = llm.get_stats()["kv_cache_usage"]
    engine.abort_request("drop")
    assert llm.get_stats()["kv_cache_usage"] < used_by_both  # freed at once, not at the next step
    engine.abort_request(["drop", "never-existed"])  # finished or unknown ids are no-ops
    finished = []
    while engine.has_unfinished_requests():
        finished += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in finished] == ["keep"]
    assert len(finished[0].outputs[0].token_ids) == 50
    engine.abort_request("keep")
    assert llm.get_stats()["kv_cache_usage"] == 0.0


def test_get_stats_fields(llm):
    long_prompt = "A long shared instruction that spans more than two blocks of sixteen tokens each. " * 3
    llm.generate([long_prompt + "First?", long_prompt + "Second?"], GREEDY, use_tqdm=False)
    stats = llm.get_stats()
    for key in ("num_running_reqs", "num_waiting_reqs", "kv_cache_usage", "num_kv_blocks", "num_preemptions"):
        assert key in stats
    assert stats["num_kv_blocks"] == 128
    assert stats["prefix_cache_queries"] >= stats["prefix_cache_hits"] > 0


def test_reset_prefix_cache(llm):
    prompt = "A prompt long enough to fill two blocks of sixteen tokens, so that its prefix is cached. " * 2

    def hits_of_one_run() -> int:
        before = llm.get_stats()["prefix_cache_hits"]
        llm.generate(prompt, GREEDY, use_tqdm=False)
        return llm.get_stats()["prefix_cache_hits"] - before

    hits_of_one_run()
    assert hits_of_one_run() > 0  # the second run finds the first one's blocks
    assert llm.reset_prefix_cache() is True
    assert hits_of_one_run() == 0  # forgotten: computed again
    # While a request holds blocks nothing is forgotten, and the answer says so.
    engine = llm.llm_engine
    engine.add_request("holding", prompt, GREEDY)
    engine.step()
    assert llm.reset_prefix_cache() is False
    engine.abort_request("holding")
    assert hits_of_one_run() > 0


def cached_tokens_of(llm, prompt: str, cache_salt: str | None, params: SamplingParams = GREEDY):
    """The cached-token count the user sees for one generate call, and the text it produced."""
    salt = {} if cache_salt is None else {"cache_salt": cache_salt}
    (output,) = llm.generate({"prompt": prompt, **salt}, params, use_tqdm=False)
    return output.num_cached_tokens, output.outputs[0].text


def test_cache_salt_isolates_tenants_in_the_prefix_cache(llm):
    # A prompt no other test sends: three full blocks of 16 tokens, and some.
    prompt = "Tenant isolation: a prompt of three KV blocks that only this test sends, salted or not. " * 2
    num_blocks = (len(llm.get_tokenizer()(prompt).input_ids) - 1) // 16
    assert num_blocks >= 2
    runs = [cached_tokens_of(llm, prompt, salt) for salt in (None, "tenant-a", "tenant-b", "tenant-a", None)]
    # Each tenant computes the prompt once; only its own second request (and the unsalted one's)
    # finds its blocks, whole blocks of them.
    assert [cached for cached, _ in runs] == [0, 0, 0, num_blocks * 16, num_blocks * 16]
    assert len({text for _, text in runs}) == 1  # the salt changes what is cached, never the output


def test_cache_salt_carries_through_beam_search_and_parallel_samples(llm):
    """Every sequence of a beam search or an n > 1 request publishes its blocks under the salt."""
    beam_prompt = "Beam search under a salt: a prompt of two KV blocks or more, sent by this test alone."
    llm.beam_search(
        [{"prompt": beam_prompt, "cache_salt": "beams"}], BeamSearchParams(beam_width=2, max_tokens=4)
    )
    sampled_prompt = "Parallel samples under a salt: a prompt of two KV blocks or more, from this test alone."
    llm.generate(
        {"prompt": sampled_prompt, "cache_salt": "samples"},
        SamplingParams(n=2, temperature=1.0, seed=0, max_tokens=4),
        use_tqdm=False,
    )
    for prompt, salt in ((beam_prompt, "beams"), (sampled_prompt, "samples")):
        assert cached_tokens_of(llm, prompt, "someone-else")[0] == 0
        assert cached_tokens_of(llm, prompt, salt)[0] > 0


@pytest.mark.parametrize("salt", ["", 3])
def test_a_salt_that_is_not_a_non_empty_string_is_refused(llm, salt):
    with pytest.raises(ValueError, match=r"^cache_salt must be a non-empty string"):
        llm.generate({"prompt": "Hello", "cache_salt": salt}, GREEDY, use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()


def test_engine_config_yaml_round_trip(tmp_path: Path):
    path = tmp_path / "engine.yaml"
    path.write_text("dtype: float32\nnum_kv_blocks: 32\nkv_cache_memory: 1GiB\nmax_num_seqs: 8\n")
    config = EngineConfig.from_yaml(path)
    assert (config.cache.num_kv_blocks, config.cache.kv_cache_memory) == (32, 2**30)
    assert config.scheduler.max_num_seqs == 8
    path.write_text("dtype: float32\nblock_sizes: 8\n")
    with pytest.raises(ValueError, match="unknown engine config key 'block_sizes'"):
        EngineConfig.from_yaml(path)
