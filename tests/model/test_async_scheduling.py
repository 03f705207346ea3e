"""Async scheduling on SmolLM2 (float32, CPU): the engine plans step N+1 while step N runs on the
worker thread, the workers filling each placeholder from their own sample. Every output must be
token for token the synchronous engine's (the package's `llm`, same settings but async scheduling),
for greedy and seeded sampling, penalties, stops, parallel samples, prefix hits, chunked prefill
and preemption; beam search and structured outputs (which run in plain steps) still work; and
whatever ends while a step is in flight (a stop, an abort) leaves no block held.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import jsonschema
import pytest

from engine import LLM, BeamSearchParams, SamplingParams, StructuredOutputsParams
from engine.process.core import EngineCore

pytestmark = pytest.mark.slow  # SmolLM2 in float32, two engines and the tight pair

PROMPTS = ["The capital of France is", "Count: 1, 2, 3,", "Once upon a time"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=16)


@pytest.fixture(scope="module")
def async_llm() -> Iterator[LLM]:
    """The package `llm`'s settings, with async scheduling."""
    engine = LLM(dtype="float32", num_kv_blocks=256, async_scheduling=True)
    yield engine
    engine.llm_engine.shutdown()


@pytest.fixture(scope="module")
def tight_pair() -> Iterator[tuple[LLM, LLM]]:
    """A sync and an async engine with a small step budget (prompts are prefilled in chunks) and a
    small cache (requests are preempted, a group of samples swapped out)."""
    settings = {
        "dtype": "float32",
        "num_kv_blocks": 8,
        "block_size": 16,
        "max_num_batched_tokens": 32,
        "max_num_seqs": 8,
    }
    pair = (LLM(**settings), LLM(**settings, async_scheduling=True))
    yield pair
    for engine in pair:
        engine.llm_engine.shutdown()


def core_of(llm: LLM) -> EngineCore:
    return llm.llm_engine.engine_core.engine_core


def completions(llm: LLM, prompts, params) -> list[list[tuple]]:
    """Each request's completions: (token ids, text, finish reason, stop reason)."""
    return [
        [(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in output.outputs]
        for output in llm.generate(prompts, params, use_tqdm=False)
    ]


def assert_same(sync: LLM, async_llm: LLM, prompts, params) -> list[list[tuple]]:
    expected = completions(sync, prompts, params)
    assert completions(async_llm, prompts, params) == expected
    assert async_llm.get_stats()["kv_cache_usage"] == 0.0
    return expected


def test_the_engine_runs_ahead(async_llm):
    core = core_of(async_llm)
    assert core.scheduler.async_scheduling and core.max_batches_in_flight == 2
    assert core_of(async_llm).executor._thread is not None  # the worker runs on a thread of its own


def test_greedy(llm, async_llm):
    results = assert_same(llm, async_llm, PROMPTS, GREEDY)
    assert all(len(r[0][0]) == 16 for r in results)


def test_max_tokens_are_exact(llm, async_llm):
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (1, 2, 7)]
    results = assert_same(llm, async_llm, PROMPTS, params)
    assert [len(r[0][0]) for r in results] == [1, 2, 7]
    assert {r[0][2] for r in results} == {"length"}


def test_eos_stop(llm, async_llm):
    params = SamplingParams(temperature=0.0, max_tokens=100)
    chat = [[{"role": "user", "content": "Say hi."}]]
    expected = llm.chat(chat, params, use_tqdm=False)[0].outputs[0]
    got = async_llm.chat(chat, params, use_tqdm=False)[0].outputs[0]
    assert got.finish_reason == expected.finish_reason == "stop"
    assert got.token_ids == expected.token_ids
    assert got.token_ids[-1] == async_llm.get_tokenizer().eos_token_id
    assert async_llm.get_stats()["kv_cache_usage"] == 0.0


def test_seeded_sampling(llm, async_llm):
    params = [SamplingParams(temperature=0.8, top_p=0.95, seed=seed, max_tokens=16) for seed in (1, 2, 3)]
    assert_same(llm, async_llm, PROMPTS, params)


def test_parallel_samples_with_seeds(llm, async_llm):
    params = SamplingParams(n=3, temperature=0.8, seed=11, max_tokens=12)
    (result,) = assert_same(llm, async_llm, ["Write a list of fruits:"], params)
    assert len(result) == 3 and len({tuple(c[0]) for c in result}) > 1


def test_stop_strings(llm, async_llm):
    text = completions(llm, [PROMPTS[1]], GREEDY)[0][0][1]
    stop = text[4:7]  # somewhere in the middle of the greedy text
    params = SamplingParams(temperature=0.0, max_tokens=16, stop=[stop])
    ((result,),) = assert_same(llm, async_llm, [PROMPTS[1]], params)
    assert result[2:] == ("stop", stop) and stop not in result[1]


def test_repetition_penalty_and_min_tokens(llm, async_llm):
    chat = [[{"role": "user", "content": "Say hi."}]]
    params = SamplingParams(
        temperature=0.0,
        max_tokens=24,
        min_tokens=12,
        repetition_penalty=1.3,
        frequency_penalty=0.2,
        presence_penalty=0.1,
    )
    expected = llm.chat(chat, params, use_tqdm=False)[0].outputs[0]
    got = async_llm.chat(chat, params, use_tqdm=False)[0].outputs[0]
    assert got.token_ids == expected.token_ids and len(got.token_ids) >= 12
    assert async_llm.get_stats()["kv_cache_usage"] == 0.0


def test_prefix_cache_hits(llm, async_llm):
    shared = "A long shared instruction that spans more than two blocks of sixteen tokens each. " * 3
    prompts = [shared + "First question?", shared + "Second question?"]
    hits = async_llm.get_stats()["prefix_cache_hits"]
    assert_same(llm, async_llm, prompts, GREEDY)
    # Again: now the whole prompts (and the blocks decoded on placeholders) are cached.
    assert_same(llm, async_llm, prompts, GREEDY)
    assert async_llm.get_stats()["prefix_cache_hits"] > hits


def test_chunked_prefill_and_preemption(tight_pair):
    sync, async_llm = tight_pair
    prompts = [
        "Tell me a long story about a dragon who lived in a cave by the sea, and the knight who came.",
        "Describe the water cycle in detail, from the ocean to the clouds and back again to the rivers.",
        "List the planets of the solar system with a short note on each one of them, in order.",
    ]
    params = [
        SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True),
        SamplingParams(temperature=0.8, seed=4, max_tokens=40, ignore_eos=True),
        SamplingParams(n=2, temperature=0.8, seed=9, max_tokens=24, ignore_eos=True),
    ]
    results = assert_same(sync, async_llm, prompts, params)
    assert [[len(c[0]) for c in r] for r in results] == [[40], [40], [24, 24]]  # none cut short
    assert sync.get_stats()["num_preemptions"] > 0
    assert async_llm.get_stats()["num_preemptions"] > 0


def test_beam_search_runs_in_plain_steps(llm, async_llm):
    beams = BeamSearchParams(beam_width=2, max_tokens=6)
    expected = [[s.tokens for s in r.sequences] for r in llm.beam_search(PROMPTS[:2], beams)]
    assert [[s.tokens for s in r.sequences] for r in async_llm.beam_search(PROMPTS[:2], beams)] == expected
    assert async_llm.get_stats()["kv_cache_usage"] == 0.0


def test_structured_outputs_beside_plain_requests(llm, async_llm):
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    constrained = SamplingParams(
        temperature=1.0, seed=2, max_tokens=60, structured_outputs=StructuredOutputsParams(json=schema)
    )
    chats = [
        [{"role": "user", "content": "Give a person as JSON."}],
        [{"role": "user", "content": "Say hi."}],
    ]
    params = [constrained, SamplingParams(temperature=0.0, max_tokens=20)]
    expected = [o.outputs[0].token_ids for o in llm.chat(chats, params, use_tqdm=False)]
    outputs = async_llm.chat(chats, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    jsonschema.validate(json.loads(outputs[0].outputs[0].text), schema)
    assert async_llm.get_stats()["kv_cache_usage"] == 0.0


def test_abort_mid_flight_frees_every_block(llm, async_llm):
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    expected = completions(llm, ["Tell me about the sea."], params)[0][0][0]
    engine = async_llm.llm_engine
    engine.add_request("keep", "Tell me about the sea.", params)
    engine.add_request("drop", "Tell me about the sky.", params)
    for _ in range(4):
        engine.step()
    in_flight = core_of(async_llm).batch_queue
    assert any("drop" in out.num_scheduled_tokens for out, _ in in_flight)  # mid-flight
    used_by_both = async_llm.get_stats()["kv_cache_usage"]
    engine.abort_request("drop")
    assert async_llm.get_stats()["kv_cache_usage"] < used_by_both  # freed at once
    finished = []
    while engine.has_unfinished_requests():
        finished += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in finished] == ["keep"]
    assert finished[0].outputs[0].token_ids == expected
    assert async_llm.get_stats()["kv_cache_usage"] == 0.0


def test_a_request_id_may_be_reused_while_a_step_of_its_namesake_is_in_flight(async_llm):
    """A stop string ends "x" one step late: the step planned after its last token is still in
    flight (the front end stops stepping once nothing is unfinished) when a new "x" comes."""
    engine = async_llm.llm_engine

    def run(request_id: str, prompt: str, params: SamplingParams) -> list[int]:
        engine.add_request(request_id, prompt, params)
        finished = []
        while engine.has_unfinished_requests():
            finished += [o for o in engine.step() if o.finished]
        (output,) = finished
        return output.outputs[0].token_ids

    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    fresh = run("fresh", "Hello there", greedy)
    run("x", "Count: 1, 2, 3,", SamplingParams(temperature=0.0, max_tokens=8, stop=[","]))
    assert any("x" in out.num_scheduled_tokens for out, _ in core_of(async_llm).batch_queue)
    assert run("x", "Hello there", greedy) == fresh
    assert async_llm.get_stats()["kv_cache_usage"] == 0.0


def test_an_engine_steps_beside_another_engines_worker_thread(llm, async_llm):
    """The forward context is per thread: the async engine's worker may still run its last step
    (planned after a stop) while another engine in the process runs a forward pass."""
    params = SamplingParams(temperature=0.0, max_tokens=8, stop=[","])
    # A few tokens are enough: the steps overlap, if at all, at the start of the other engine's run.
    short = SamplingParams(temperature=0.0, max_tokens=4)
    for _ in range(3):
        async_llm.generate(PROMPTS[1], params, use_tqdm=False)
        assert core_of(async_llm).batch_queue  # its last step is left running
        assert completions(llm, PROMPTS, short) == completions(async_llm, PROMPTS, short)
