"""Structured outputs on SmolLM2, offline: every output holds to its constraint, checked with
`jsonschema`, `re` and plain string comparison (independently of the grammar library), at
temperature 1.0 and several seeds; with n > 1, beam search, stop strings, max_tokens, the prefix
cache, chunked prefill and preemption; and an unconstrained request is untouched by its neighbours.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from engine import LLM, BeamSearchParams, SamplingParams, StructuredOutputsParams
from tests.structured.schemas import SCHEMAS

CHOICES = ["red", "green", "blue", "yellow"]
PHONE = r"\d{3}-\d{3}-\d{4}"


def constrained(seed: int, max_tokens: int = 120, **constraint: object) -> SamplingParams:
    return SamplingParams(
        temperature=1.0,
        seed=seed,
        max_tokens=max_tokens,
        structured_outputs=StructuredOutputsParams(**constraint),
    )


def ask(prompt: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": prompt}]


def test_json_schemas_hold_at_temperature_one(llm: LLM) -> None:
    cases = SCHEMAS[::4]  # a spread of them; the server tests take every one, on both endpoints
    outputs = llm.chat(
        [ask(case.prompt + " Answer in JSON.") for case in cases for _ in range(2)],
        [constrained(seed, json=case.schema) for case in cases for seed in (1, 2)],
        use_tqdm=False,
    )
    for index, output in enumerate(outputs):
        case, completion = cases[index // 2], output.outputs[0]
        assert completion.finish_reason == "stop", (case.name, completion.text)
        jsonschema.validate(json.loads(completion.text), case.schema)


def test_regex_choice_grammars_and_json_object(llm: LLM) -> None:
    gbnf = 'root ::= "The answer is " answer "."\nanswer ::= "yes" | "no" | [0-9] [0-9]?'
    lark = 'start: "ab" tail\ntail: /[xyz]{2,4}/'
    params = [
        *(constrained(seed, regex=PHONE) for seed in range(3)),
        *(constrained(seed, choice=CHOICES) for seed in range(3)),
        *(constrained(seed, grammar=gbnf) for seed in range(3)),
        *(constrained(seed, grammar=lark) for seed in range(3)),
    ]
    texts = [
        output.outputs[0].text
        for output in llm.generate(["Tell me something:"] * len(params), params, use_tqdm=False)
    ]
    assert all(re.fullmatch(PHONE, text) for text in texts[0:3]), texts[0:3]
    assert all(text in CHOICES for text in texts[3:6]), texts[3:6]
    assert all(re.fullmatch(r"The answer is (yes|no|[0-9][0-9]?)\.", text) for text in texts[6:9]), texts[6:9]
    assert all(re.fullmatch(r"ab[xyz]{2,4}", text) for text in texts[9:12]), texts[9:12]


def test_json_object_gives_a_json_object(llm: LLM) -> None:
    # Any object: nothing bounds its strings, so a sampling temperature that keeps a 135M model on
    # topic (at 1.0 it may ramble until max_tokens, which is no JSON yet).
    params = [
        SamplingParams(
            temperature=0.5,
            seed=seed,
            max_tokens=100,
            structured_outputs=StructuredOutputsParams(json_object=True),
        )
        for seed in range(4)
    ]
    outputs = llm.chat(
        [ask("Give a JSON object with the name and the age of a person.")] * 4, params, use_tqdm=False
    )
    ended = [output.outputs[0].text for output in outputs if output.outputs[0].finish_reason == "stop"]
    assert len(ended) >= 2 and all(isinstance(json.loads(text), dict) for text in ended), ended
    assert all(output.outputs[0].text.startswith("{") for output in outputs)


def test_each_parallel_sample_holds_to_the_constraint(llm: LLM) -> None:
    params = SamplingParams(
        n=3,
        temperature=1.0,
        seed=5,
        max_tokens=40,
        structured_outputs=StructuredOutputsParams(regex=r"[a-z]{3,8}( [a-z]{3,8}){2}"),
    )
    (output,) = llm.generate(["Three words:"], params, use_tqdm=False)
    texts = [completion.text for completion in output.outputs]
    assert len(texts) == 3 and len(set(texts)) > 1
    assert all(re.fullmatch(r"[a-z]{3,8}( [a-z]{3,8}){2}", text) for text in texts), texts


def test_beam_search_keeps_every_beam_within_the_constraint(llm: LLM) -> None:
    params = BeamSearchParams(
        beam_width=3, max_tokens=12, structured_outputs=StructuredOutputsParams(choice=CHOICES)
    )
    (result,) = llm.beam_search(["My favourite color is"], params)
    texts = [beam.text[len("My favourite color is") :] for beam in result.sequences]
    assert len(texts) == 3 and all(text in CHOICES for text in texts), texts


def test_stop_strings_and_max_tokens_end_a_constrained_output(llm: LLM) -> None:
    stopped, capped = llm.generate(
        ["Numbers:", "Numbers:"],
        [
            SamplingParams(
                temperature=0.0,
                max_tokens=40,
                stop=["-"],
                structured_outputs=StructuredOutputsParams(regex=PHONE),
            ),
            SamplingParams(
                temperature=1.0,
                seed=3,
                max_tokens=3,
                # At least five items: the array cannot close within the 3 tokens, whatever the draws.
                structured_outputs=StructuredOutputsParams(
                    json={"type": "array", "items": {"type": "integer"}, "minItems": 5}
                ),
            ),
        ],
        use_tqdm=False,
    )
    assert re.fullmatch(r"\d{3}", stopped.outputs[0].text) and stopped.outputs[0].stop_reason == "-"
    assert stopped.outputs[0].finish_reason == "stop"
    assert capped.outputs[0].finish_reason == "length" and len(capped.outputs[0].token_ids) == 3


def test_an_unconstrained_request_is_the_same_beside_constrained_ones(llm: LLM) -> None:
    free = SamplingParams(temperature=0.0, max_tokens=24)
    prompt = "Write a short sentence about the sea."
    (alone,) = llm.generate([prompt], free, use_tqdm=False)
    crowd = llm.generate(
        [prompt] + ["Give me data:"] * 6,
        [free] + [constrained(seed, json=SCHEMAS[seed].schema) for seed in range(6)],
        use_tqdm=False,
    )
    assert crowd[0].outputs[0].token_ids == alone.outputs[0].token_ids


def test_a_cached_prefix_serves_a_constrained_request(llm: LLM) -> None:
    prompt = "A long shared prefix about colors, repeated to fill more than one block of the cache. " * 3
    first, second = (
        llm.generate([prompt], constrained(seed, choice=CHOICES), use_tqdm=False)[0] for seed in (1, 2)
    )
    assert second.num_cached_tokens >= 32
    assert first.outputs[0].text in CHOICES and second.outputs[0].text in CHOICES


def test_bad_constraints_are_refused_before_scheduling(llm: LLM) -> None:
    cases = {
        "structured_outputs.regex": StructuredOutputsParams(regex="[a-"),
        "structured_outputs.grammar": StructuredOutputsParams(grammar="root ::= undefined_rule"),
        "structured_outputs.json": StructuredOutputsParams(json={"type": "array", "uniqueItems": True}),
    }
    for field, constraint in cases.items():
        with pytest.raises(ValueError, match=re.escape(field)):
            llm.generate(["x"], SamplingParams(structured_outputs=constraint), use_tqdm=False)
    with pytest.raises(ValueError, match="only use one kind of constraint"):
        StructuredOutputsParams(regex="a", choice=["a"])
    assert llm.generate(["x"], SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].finish_reason


@pytest.fixture(scope="module")
def tight_llm() -> LLM:
    """Chunked prefill (16-token chunks) and a cache too small for the batch below at once."""
    engine = LLM(
        dtype="float32",
        num_kv_blocks=12,
        block_size=16,
        max_num_batched_tokens=16,
        max_num_seqs=8,
        swap_space=0.01,
    )
    yield engine
    engine.llm_engine.shutdown()


@pytest.mark.slow  # an engine of its own
def test_chunked_prefill_and_preemption_keep_the_constraint(tight_llm: LLM) -> None:
    prompts = [
        f"Prompt number {index}: a long prompt that takes more than one chunk of sixteen tokens to prefill, "
        "so that it is computed in pieces. Now some words:"
        for index in range(4)
    ]
    pattern = r"[a-z]{4,10}( [a-z]{4,10}){14,16}"
    params = [constrained(seed, max_tokens=100, regex=pattern) for seed in range(3)]
    params.append(  # a group of two: preempted by swapping
        SamplingParams(
            n=2,
            temperature=1.0,
            seed=9,
            max_tokens=100,
            structured_outputs=StructuredOutputsParams(regex=pattern),
        )
    )
    outputs = tight_llm.generate(prompts, params, use_tqdm=False)
    assert tight_llm.get_stats()["num_preemptions"] > 0
    texts = [completion.text for output in outputs for completion in output.outputs]
    assert len(texts) == 5 and all(re.fullmatch(pattern, text) for text in texts), texts
