"""Parallel sampling, best_of and beam search on shared blocks; swap preemption; stop strings."""

from __future__ import annotations

import pytest

from engine import LLM, BeamSearchParams, SamplingParams
from tests.model.tiny_models import write_tiny_model

PROMPT = "Write one sentence about the history of the printing press in Europe and its effects on"
SEEDED = SamplingParams(n=4, temperature=1.0, top_p=0.95, seed=11, max_tokens=20, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """A tiny Llama with SmolLM2's tokenizer: the same prompts take the same blocks as on SmolLM2, so
    the swap tests put the cache under the same pressure at a fraction of the compute."""
    return str(write_tiny_model(tmp_path_factory.mktemp("tiny") / "model"))


def tight_llm(model: str) -> LLM:
    """14 blocks of 16 tokens: too few for the swap tests' sequences at once."""
    return LLM(model, dtype="float32", num_kv_blocks=14, block_size=16, swap_space=0.01)


def scheduler_of(llm):
    return llm.llm_engine.engine_core.engine_core.scheduler


def record_schedules(llm, monkeypatch):
    """Every SchedulerOutput the engine produces from now on."""
    scheduler = scheduler_of(llm)
    outputs = []
    schedule = scheduler.schedule

    def recording():
        scheduled = schedule()
        outputs.append(scheduled.scheduler_output)
        return scheduled

    monkeypatch.setattr(scheduler, "schedule", recording)
    return outputs


def token_ids(output) -> list[list[int]]:
    return [completion.token_ids for completion in output.outputs]


def test_seeded_n4_is_reproducible_and_independent_of_the_batch(llm):
    alone = llm.generate(PROMPT, SEEDED, use_tqdm=False)[0]
    assert [c.index for c in alone.outputs] == [0, 1, 2, 3]
    assert len({tuple(ids) for ids in token_ids(alone)}) == 4  # four different samples
    again = llm.generate(PROMPT, SEEDED, use_tqdm=False)[0]
    crowd = llm.generate(
        ["Another prompt entirely.", PROMPT, "And a third one, longer than the others by a few words."],
        [
            SamplingParams(temperature=1.0, max_tokens=30),
            SEEDED,
            SamplingParams(n=2, temperature=0.7, max_tokens=9),
        ],
        use_tqdm=False,
    )[1]
    assert token_ids(again) == token_ids(alone)
    assert token_ids(crowd) == token_ids(alone)


def test_forks_share_the_prompt_blocks_and_copy_the_partial_one_once_per_writer(llm, monkeypatch):
    prompt_ids = llm.get_tokenizer()(PROMPT).input_ids
    assert (len(prompt_ids) - 1) % 16 != 0  # the last prompt token lands in a partly filled block
    schedules = record_schedules(llm, monkeypatch)
    engine = llm.llm_engine
    engine.add_request("shared", {"prompt_token_ids": prompt_ids}, SEEDED)
    kv = scheduler_of(llm).kv_cache_manager
    engine.step()  # prefill: the prompt but its last token
    full_blocks = (len(prompt_ids) - 1) // 16
    assert kv.num_blocks - kv.num_free_blocks == full_blocks + 1
    engine.step()  # the four sequences compute the last prompt token: forks, copy-on-write
    tables = [kv.block_ids("shared"), *(kv.block_ids(f"shared#{i}") for i in range(1, 4))]
    # The full prompt blocks were allocated once and are shared by all four sequences...
    assert all(table[:full_blocks] == tables[0][:full_blocks] for table in tables)
    # ...and the partial block holds four private copies now: three copied, the last writer kept it.
    assert len({table[full_blocks] for table in tables}) == 4
    copies = schedules[1].blocks_to_copy
    assert len(copies) == 3 and len({dst for _, dst in copies}) == 3
    assert kv.num_blocks - kv.num_free_blocks == full_blocks + 4
    while engine.has_unfinished_requests():
        engine.step()
    assert sum(len(s.blocks_to_copy) for s in schedules) == 3  # nothing is ever copied twice
    assert kv.num_free_blocks == kv.num_blocks


def test_best_of_returns_the_n_most_likely_of_its_samples(llm):
    params = SamplingParams(n=2, best_of=5, temperature=1.0, seed=3, max_tokens=12, logprobs=0)
    output = llm.generate(PROMPT, params, use_tqdm=False)[0]
    everything = llm.generate(
        PROMPT, SamplingParams(n=5, temperature=1.0, seed=3, max_tokens=12, logprobs=0), use_tqdm=False
    )[0]
    ranked = sorted(everything.outputs, key=lambda c: c.cumulative_logprob, reverse=True)
    assert token_ids(output) == [c.token_ids for c in ranked[:2]]
    for completion in output.outputs:  # the cumulative log-probability is the sum of the token ones
        assert completion.cumulative_logprob == pytest.approx(
            sum(lp[t].logprob for t, lp in zip(completion.token_ids, completion.logprobs, strict=True)),
            abs=1e-4,
        )


def test_swap_preemption_keeps_outputs_and_frees_every_block(tiny_model):
    prompts = [PROMPT, "Tell me about rivers and mountains, briefly.", "List some animals:"]
    params = [SEEDED, SamplingParams(n=3, temperature=0.8, seed=5, max_tokens=24, ignore_eos=True), SEEDED]
    beams = BeamSearchParams(beam_width=3, max_tokens=12)
    roomy = LLM(tiny_model, dtype="float32", num_kv_blocks=256, block_size=16)
    expected = token_ids_all(roomy.generate(prompts, params, use_tqdm=False))
    expected_beams = [s.tokens for s in roomy.beam_search(prompts[1], beams)[0].sequences]

    tight = tight_llm(tiny_model)
    assert token_ids_all(tight.generate(prompts, params, use_tqdm=False)) == expected
    assert [s.tokens for s in tight.beam_search(prompts[1], beams)[0].sequences] == expected_beams
    scheduler = scheduler_of(tight)
    assert scheduler.num_preemptions > 0
    kv = scheduler.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks
    assert kv.cpu_pool.num_free_blocks == kv.cpu_pool.num_blocks


def token_ids_all(outputs) -> list[list[list[int]]]:
    return [token_ids(output) for output in outputs]


def test_swap_happens_under_pressure(tiny_model, monkeypatch):
    tight = tight_llm(tiny_model)
    schedules = record_schedules(tight, monkeypatch)
    tight.generate([PROMPT, PROMPT + " Europe"], SEEDED, use_tqdm=False)
    swapped_out = sum(len(s.blocks_to_swap_out) for s in schedules)
    swapped_in = sum(len(s.blocks_to_swap_in) for s in schedules)
    assert swapped_out > 0 and swapped_in == swapped_out


def test_stop_strings_cut_the_text_of_each_sequence(llm):
    prompt = "List the days of the week, one per line:"
    free = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=40), use_tqdm=False)[0].outputs[0]
    word = free.text.split()[3]  # a word from the middle of the greedy text
    assert len(word) > 2
    cut = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=40, stop=[word]), use_tqdm=False)[0]
    completion = cut.outputs[0]
    assert completion.text == free.text[: free.text.index(word)]
    assert (completion.finish_reason, completion.stop_reason) == ("stop", word)
    kept = llm.generate(
        prompt,
        SamplingParams(temperature=0.0, max_tokens=40, stop=[word], include_stop_str_in_output=True),
        use_tqdm=False,
    )[0]
    assert kept.outputs[0].text == free.text[: free.text.index(word) + len(word)]
    assert llm.get_stats()["kv_cache_usage"] == 0.0


@pytest.mark.parametrize(
    "settings,message",
    [
        ({"n": 2, "best_of": 1}, "best_of must be greater than or equal to n"),
        ({"best_of": 0}, "best_of must be at least 1"),
        ({"n": 3, "temperature": 0.0}, "n and best_of must be 1 with greedy sampling"),
        ({"min_tokens": 20, "max_tokens": 10}, "min_tokens must be less than or equal to max_tokens=10"),
        ({"stop": ["ok", ""]}, "stop cannot contain an empty string"),
        ({"presence_penalty": 3.0}, r"presence_penalty must be in \[-2, 2\]"),
        ({"repetition_penalty": 0.0}, "repetition_penalty must be greater than zero"),
        ({"min_p": 1.5}, r"min_p must be in \[0, 1\]"),
    ],
)
def test_invalid_decoding_settings(settings, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**settings)


def test_limits_checked_against_the_model(llm):
    with pytest.raises(
        ValueError, match="logprobs: requested 21 log-probabilities, more than max_logprobs=20"
    ):
        llm.generate("hi", SamplingParams(logprobs=21), use_tqdm=False)
    with pytest.raises(ValueError, match="prompt_logprobs: requested 30"):
        llm.generate("hi", SamplingParams(prompt_logprobs=30), use_tqdm=False)
    with pytest.raises(ValueError, match="logit_bias: token id 99999 is out of vocabulary"):
        llm.generate("hi", SamplingParams(logit_bias={99999: 1.0}), use_tqdm=False)
    narrow = LLM(dtype="float32", num_kv_blocks=32, max_num_seqs=4)
    with pytest.raises(ValueError, match=r"n=8 is more sequences than one step runs \(max_num_seqs=4\)"):
        narrow.generate("hi", SamplingParams(n=8, temperature=1.0), use_tqdm=False)
    with pytest.raises(ValueError, match=r"beam_width=5 is more sequences"):
        narrow.beam_search("hi", BeamSearchParams(beam_width=5, max_tokens=3))
    with pytest.raises(ValueError, match="beam_width must be at least 1"):
        BeamSearchParams(beam_width=0, max_tokens=4)
    assert not llm.llm_engine.has_unfinished_requests()
    assert (
        len(
            llm.generate("hi", SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)[0]
            .outputs[0]
            .token_ids
        )
        == 3
    )


def test_the_swap_pool_holds_what_max_num_seqs_rows_can_swap_out(tiny_model):
    # The tiny model's block is 8 KiB (2 layers x K and V x 2 heads x 16 tokens x 16 dims x 4 bytes):
    # swap_space's default 4 GiB would be half a million of them. No request is admitted while one
    # is swapped out, so at most max_num_seqs rows of max_model_len tokens (13 blocks) ever are.
    llm = LLM(tiny_model, dtype="float32", num_kv_blocks=14, block_size=16, max_model_len=200, max_num_seqs=3)
    assert scheduler_of(llm).kv_cache_manager.cpu_pool.num_blocks == 3 * 13
    # Where swap_space holds fewer, it is the bound: 0.01 GiB of 8 KiB blocks.
    assert scheduler_of(tight_llm(tiny_model)).kv_cache_manager.cpu_pool.num_blocks == (2**30 // 100) // 8192
