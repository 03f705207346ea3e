"""The front end's output kinds and stats, from hand-made core outputs (no model, no process)."""

from __future__ import annotations

import functools

import pytest

from engine.frontend.output_processor import OutputProcessor
from engine.frontend.stats import IterationStats
from engine.frontend.tokenizer import load_tokenizer
from engine.models.model_files import ModelSource, packaged_model_path
from engine.outputs import EngineCoreOutput, EngineCoreRequest, FinishReason
from engine.sampling_params import RequestOutputKind, SamplingParams

DELTA, CUMULATIVE, FINAL_ONLY = (
    RequestOutputKind.DELTA,
    RequestOutputKind.CUMULATIVE,
    RequestOutputKind.FINAL_ONLY,
)


@functools.cache
def tokenizer():
    return load_tokenizer(ModelSource(packaged_model_path(), "gguf"))


def encode(text: str) -> list[int]:
    return tokenizer()(text, add_special_tokens=False).input_ids


def start(processor: OutputProcessor, request_id: str, **params) -> None:
    request = EngineCoreRequest(
        request_id, encode("Say:"), SamplingParams(**params), None, arrival_time=100.0
    )
    processor.add_request(request, "Say:")


def feed(processor, request_id, tokens_per_step, index=0, stats=None, finish_last=True):
    """Each step's tokens as one core output; the last finishes the sequence (by length)."""
    results = []
    for step, tokens in enumerate(tokens_per_step):
        last = finish_last and step == len(tokens_per_step) - 1
        output = EngineCoreOutput(
            request_id,
            index,
            tokens,
            finish_reason=FinishReason.LENGTH if last else None,
            request_finished=last,
        )
        results += processor.process_outputs([output], stats)[0]
    return results


@pytest.mark.parametrize("stop", [None, ["world!"]])
def test_deltas_concatenate_to_the_cumulative_text(stop):
    tokens = encode(" Hello there, big world! And more")
    steps = [tokens[i : i + 1] for i in range(len(tokens))]
    processor = OutputProcessor(tokenizer())
    start(processor, "d", output_kind=DELTA, stop=stop)
    start(processor, "c", output_kind=CUMULATIVE, stop=stop)
    deltas = feed(processor, "d", steps)
    cumulative = feed(processor, "c", steps)
    final = cumulative[-1].outputs[0]
    assert "".join(o.outputs[0].text for o in deltas) == final.text
    assert [t for o in deltas for t in o.outputs[0].token_ids] == final.token_ids
    assert deltas[-1].finished and deltas[-1].outputs[0].finish_reason == final.finish_reason
    if stop:
        # Text that could start the stop string is held back, never sent and then taken back.
        assert final.text == " Hello there, big " and final.stop_reason == "world!"


def test_final_only_yields_one_output():
    processor = OutputProcessor(tokenizer())
    start(processor, "f", output_kind=FINAL_ONLY)
    results = feed(processor, "f", [encode(" one"), encode(" two"), encode(" three")])
    assert len(results) == 1 and results[0].finished and results[0].outputs[0].text == " one two three"


def test_best_of_streams_its_pick_only_at_the_end():
    processor = OutputProcessor(tokenizer())
    start(processor, "b", output_kind=DELTA, n=1, best_of=2, temperature=1.0)
    outputs = []
    for index, (text, logprob) in enumerate([(" worse", -5.0), (" better", -1.0)]):
        output = EngineCoreOutput("b", index, encode(text), finish_reason=FinishReason.LENGTH)
        output.cumulative_logprob = logprob
        outputs.append(output)
    assert processor.process_outputs(outputs[:1])[0] == []
    (result,) = processor.process_outputs(outputs[1:])[0]
    assert result.finished and [(c.index, c.text) for c in result.outputs] == [(0, " better")]


@pytest.mark.parametrize("kind", list(RequestOutputKind))
def test_an_aborted_request_ends_with_finish_reason_abort(kind):
    processor = OutputProcessor(tokenizer())
    start(processor, "a", output_kind=kind, n=2, temperature=1.0)
    feed(processor, "a", [encode(" partial")], finish_last=False)
    finished = []
    (output,) = processor.abort_requests(["a", "unknown"], finished)
    assert output.finished and [c.finish_reason for c in output.outputs] == ["abort", "abort"]
    assert [r.finish_reason for r in finished] == ["abort"] and not processor.requests
    expected_text = "" if kind == DELTA else " partial"
    assert output.outputs[0].text == expected_text


def test_iteration_stats_count_tokens_and_time_requests():
    processor = OutputProcessor(tokenizer())
    start(processor, "s", output_kind=DELTA)
    prompt_len = len(processor.requests["s"].prompt_token_ids)
    batches = []
    for step, tokens in enumerate([encode(" a b"), encode(" c"), encode(" d")]):
        stats = IterationStats()
        last = step == 2
        output = EngineCoreOutput(
            "s", 0, tokens, finish_reason=FinishReason.LENGTH if last else None, request_finished=last
        )
        output.first_scheduled_time = 100.5 if step == 0 else None
        processor.process_outputs([output], stats)
        batches.append(stats)
    assert [b.num_prompt_tokens for b in batches] == [prompt_len, 0, 0]
    assert [b.num_generation_tokens for b in batches] == [len(encode(" a b")), 1, 1]
    assert len(batches[0].time_to_first_tokens) == 1 and batches[0].time_to_first_tokens[0] > 0
    assert [len(b.inter_token_latencies) for b in batches] == [0, 1, 1]
    (done,) = batches[2].finished_requests
    assert (done.finish_reason, done.num_prompt_tokens) == ("length", prompt_len)
    assert done.num_generation_tokens == len(encode(" a b")) + 2
    assert done.queued_time == pytest.approx(0.5) and done.e2e_latency > done.queued_time
