"""The scheduling core under grammars (structured outputs), with the real llguidance backend over
SmolLM2's vocabulary and a fake worker: requests wait for their grammars, sequences sample only
what their grammar allows and stop where it is complete, forks and preemption keep each sequence's
place in its grammar, and a grammar that cannot be compiled fails its request alone.

The "model" samples, among the tokens the step's mask allows, the one a fixed pseudo-random order
ranks first (a function of the sequence so far, so recomputation cannot change it); the text each
sequence ends with is checked with Python's `re` and `json`, independently of the grammar library.
"""

from __future__ import annotations

import json
import random
import re
from concurrent.futures import Future

import numpy as np
import pytest
from tokenizers import Tokenizer

from engine.models.model_files import packaged_model_path
from engine.models.tokenizer_files import tokenizer_json
from engine.outputs import EngineCoreOutputs, FinishReason, SchedulerOutput
from engine.sampling_params import StructuredOutputsParams
from engine.sched.grammar import CompiledGrammar
from engine.sched.request import Request
from engine.sched.scheduler import Scheduler
from engine.structured.guidance import GuidanceBackend
from engine.structured.manager import grammar_bitmask
from tests.unit.scheduler_helpers import FakeWorker, make_request, make_scheduler, seq_index
from tests.unit.smollm2_tokens import IM_END, encode

VOCAB = 49152


@pytest.fixture(scope="module")
def backend() -> GuidanceBackend:
    return GuidanceBackend(tokenizer_json(packaged_model_path(), "gguf"), VOCAB, [IM_END])


def compiled(backend: GuidanceBackend, **constraint: object) -> Future[CompiledGrammar]:
    future: Future[CompiledGrammar] = Future()
    future.set_result(backend.compile(backend.grammar_text(StructuredOutputsParams(**constraint))))
    return future


class MaskedWorker(FakeWorker):
    """A fake worker whose "model" samples within the step's grammar mask (rows without one: as the
    fake worker does)."""

    def __init__(self, scheduler: Scheduler) -> None:
        super().__init__(scheduler.block_size, self._pick, scheduler)
        self.allowed: dict[str, np.ndarray] = {}

    def run(self, out: SchedulerOutput) -> None:
        self.allowed = {}
        mask = out.grammar_bitmask
        if mask is not None:
            words = np.frombuffer(mask.data, dtype="<i4").reshape(len(mask.seq_ids), mask.words)
            for seq_id, row in zip(mask.seq_ids, words, strict=True):
                bits = np.unpackbits(row.view(np.uint8), bitorder="little")[:VOCAB]
                self.allowed[seq_id] = np.flatnonzero(bits)

    def _pick(self, seq_id: str, tokens: list[int]) -> int:
        if seq_id not in self.allowed:
            return 1000 + len(tokens)
        choices = self.allowed[seq_id]
        # Forks of one request differ (as their seeds would); the end of sequence waits a little.
        rng = random.Random(hash((seq_index(seq_id), *tokens)))
        order = sorted(choices.tolist(), key=lambda _: rng.random())
        if len(order) > 1 and len(tokens) % 7 and IM_END in order:
            order.remove(IM_END)
        return order[0]


def grammar_step(
    scheduler: Scheduler, worker: MaskedWorker, backend: GuidanceBackend
) -> tuple[SchedulerOutput, EngineCoreOutputs]:
    """One engine step as EngineCore.step runs it: schedule, the grammar's masks, the worker, update."""
    scheduled = scheduler.schedule()
    out = scheduled.scheduler_output
    rows = scheduler.grammar_rows(out)
    if rows:
        out.grammar_bitmask = grammar_bitmask(backend, rows)
    worker.run(out)
    outputs = scheduler.update_from_output(out, worker.execute(out))
    outputs.outputs = scheduled.finished_outputs + outputs.outputs
    return out, outputs


def run_to_end(
    scheduler: Scheduler, worker: MaskedWorker, backend: GuidanceBackend, max_steps: int = 400
) -> dict:
    """Step until no request is left; each sequence's (tokens, finish reason, error), by 'id#index'."""
    results: dict[str, tuple[list[int], FinishReason | None, str | None]] = {}
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests():
            return results
        _, outputs = grammar_step(scheduler, worker, backend)
        for output in outputs.outputs:
            key = f"{output.request_id}#{output.index}"
            tokens = results.get(key, ([], None, None))[0] + output.new_token_ids
            results[key] = (tokens, output.finish_reason, output.error)
    raise AssertionError("requests still running after max_steps")


def text_of(tok: Tokenizer, tokens: list[int]) -> str:
    return tok.decode([t for t in tokens if t != IM_END])


def constrained(request: Request, grammar: Future[CompiledGrammar]) -> Request:
    request.grammar = grammar
    return request


def test_sequences_sample_within_the_grammar_and_stop_where_it_is_complete(backend, tok) -> None:
    scheduler = make_scheduler(num_blocks=64, block_size=16, max_num_batched_tokens=256)
    worker = MaskedWorker(scheduler)
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 8},
            "n": {"type": "integer", "minimum": 0, "maximum": 99},
        },
        "required": ["name", "n"],
        "additionalProperties": False,
    }
    prompt = encode(tok, "Describe it as JSON:")
    scheduler.add_request(
        constrained(
            make_request("json", prompt, max_tokens=64, eos_token_id=IM_END), compiled(backend, json=schema)
        )
    )
    scheduler.add_request(
        constrained(
            make_request("re", prompt, max_tokens=64, eos_token_id=IM_END),
            compiled(backend, regex=r"[a-c]{2,5}-\d"),
        )
    )
    scheduler.add_request(
        constrained(
            make_request("pick", prompt, max_tokens=64, eos_token_id=IM_END),
            compiled(backend, choice=["alpha", "beta"]),
        )
    )
    scheduler.add_request(make_request("free", prompt, max_tokens=5))
    results = run_to_end(scheduler, worker, backend)
    value = json.loads(text_of(tok, results["json#0"][0]))
    assert set(value) == {"name", "n"} and len(value["name"]) <= 8 and 0 <= value["n"] <= 99
    assert re.fullmatch(r"[a-c]{2,5}-\d", text_of(tok, results["re#0"][0]))
    assert text_of(tok, results["pick#0"][0]) in ("alpha", "beta")
    assert {results[key][1] for key in ("json#0", "re#0", "pick#0")} == {FinishReason.STOP}
    assert results["free#0"] == ([1000 + len(prompt) + i for i in range(5)], FinishReason.LENGTH, None)
    assert scheduler.kv_cache_manager.num_free_blocks == 64


def test_a_complete_grammar_ends_the_sequence_even_under_min_tokens(backend, tok) -> None:
    scheduler = make_scheduler(num_blocks=16, block_size=16)
    worker = MaskedWorker(scheduler)
    request = make_request("r", encode(tok, "Yes or no?"), max_tokens=32, min_tokens=20, eos_token_id=IM_END)
    scheduler.add_request(constrained(request, compiled(backend, choice=["yes"])))
    tokens, finish, error = run_to_end(scheduler, worker, backend)["r#0"]
    assert (text_of(tok, tokens), finish, error) == ("yes", FinishReason.STOP, None)


def test_a_request_waits_for_its_grammar_while_others_run(backend, tok) -> None:
    scheduler = make_scheduler(num_blocks=32, block_size=16)
    worker = MaskedWorker(scheduler)
    pending: Future[CompiledGrammar] = Future()
    prompt = encode(tok, "Count:")
    scheduler.add_request(
        constrained(make_request("first", prompt, max_tokens=8, eos_token_id=IM_END), pending)
    )
    scheduler.add_request(make_request("second", prompt, max_tokens=3))
    out, _ = grammar_step(scheduler, worker, backend)
    assert set(out.num_scheduled_tokens) == {"second"}  # the head of the queue waits, the next one runs
    assert scheduler.requests["first"].waits_for_grammar
    pending.set_result(backend.compile(backend.grammar_text(StructuredOutputsParams(regex=r"\d{3}"))))
    results = run_to_end(scheduler, worker, backend)
    assert re.fullmatch(r"\d{3}", text_of(tok, results["first#0"][0]))
    assert results["first#0"][1] == FinishReason.STOP


def test_a_grammar_that_cannot_compile_fails_only_its_request(backend, tok) -> None:
    scheduler = make_scheduler(num_blocks=32, block_size=16)
    worker = MaskedWorker(scheduler)
    failed: Future[CompiledGrammar] = Future()
    failed.set_exception(ValueError("too complex for this vocabulary"))
    prompt = encode(tok, "Hi")
    scheduler.add_request(constrained(make_request("bad", prompt, eos_token_id=IM_END), failed))
    scheduler.add_request(make_request("good", prompt, max_tokens=4))
    results = run_to_end(scheduler, worker, backend)
    tokens, finish, error = results["bad#0"]
    assert (tokens, finish) == ([], FinishReason.ABORT)
    assert "could not be compiled" in error and "too complex for this vocabulary" in error
    assert results["good#0"][1] == FinishReason.LENGTH and len(results["good#0"][0]) == 4
    assert scheduler.kv_cache_manager.num_free_blocks == 32


def test_parallel_samples_each_follow_their_own_matcher(backend, tok) -> None:
    scheduler = make_scheduler(num_blocks=64, block_size=16)
    worker = MaskedWorker(scheduler)
    request = make_request("n", encode(tok, "Three words:"), n=3, max_tokens=40, eos_token_id=IM_END)
    scheduler.add_request(constrained(request, compiled(backend, regex=r"(cat|dog|emu)( (cat|dog|emu)){2}")))
    results = run_to_end(scheduler, worker, backend)
    texts = [text_of(tok, results[f"n#{index}"][0]) for index in range(3)]
    assert all(re.fullmatch(r"(cat|dog|emu)( (cat|dog|emu)){2}", text) for text in texts), texts
    assert len(set(texts)) > 1  # the forks' draws differ, each within its own matcher
    assert {results[f"n#{index}"][1] for index in range(3)} == {FinishReason.STOP}


def test_preempted_sequences_keep_their_place_in_the_grammar(backend, tok) -> None:
    # Two growing requests and a cache too small for both: one is preempted (recompute) and resumes.
    scheduler = make_scheduler(num_blocks=5, block_size=4, max_num_batched_tokens=64)
    worker = MaskedWorker(scheduler)
    pattern = r"[a-z]{6}\.[0-9]{6}\.[a-z]{2}"
    for name in ("a", "b"):
        request = make_request(name, encode(tok, "Code: "), max_tokens=20, eos_token_id=IM_END)
        scheduler.add_request(constrained(request, compiled(backend, regex=pattern)))
    results = run_to_end(scheduler, worker, backend)
    assert scheduler.num_preemptions > 0
    for name in ("a", "b"):
        assert re.fullmatch(pattern, text_of(tok, results[f"{name}#0"][0]))
        assert results[f"{name}#0"][1] == FinishReason.STOP


def test_only_sampling_sequences_get_a_mask_row(backend, tok) -> None:
    # A 40-token prompt in chunks of 16: no row until the chunk that reaches its end.
    scheduler = make_scheduler(num_blocks=16, block_size=16, max_num_batched_tokens=16)
    worker = MaskedWorker(scheduler)
    prompt = encode(tok, " ".join(["word"] * 40))[:40]
    scheduler.add_request(
        constrained(make_request("long", prompt, eos_token_id=IM_END), compiled(backend, regex=r"ok"))
    )
    rows_per_step = []
    for _ in range(3):
        out, _ = grammar_step(scheduler, worker, backend)
        rows_per_step.append(out.grammar_bitmask.seq_ids if out.grammar_bitmask else [])
    assert rows_per_step == [[], [], ["long"]]


def test_swapped_groups_keep_their_place_in_the_grammar(backend, tok) -> None:
    # Groups of two sequences in a cache too small for both groups: one is swapped out, then back.
    scheduler = make_scheduler(num_blocks=8, block_size=4, max_num_batched_tokens=64, num_cpu_blocks=16)
    worker = MaskedWorker(scheduler)
    pattern = r"[a-z]{5}\.[0-9]{5}\.[a-z]{3}"
    for name in ("a", "b"):
        request = make_request(name, encode(tok, "Code: "), n=2, max_tokens=24, eos_token_id=IM_END)
        scheduler.add_request(constrained(request, compiled(backend, regex=pattern)))
    swapped = False
    results: dict[str, tuple[list[int], FinishReason | None]] = {}
    for _ in range(200):
        if not scheduler.has_unfinished_requests():
            break
        out, outputs = grammar_step(scheduler, worker, backend)
        swapped |= bool(out.blocks_to_swap_out)
        for output in outputs.outputs:
            key = f"{output.request_id}#{output.index}"
            results[key] = (results.get(key, ([], None))[0] + output.new_token_ids, output.finish_reason)
    assert swapped
    assert sorted(results) == ["a#0", "a#1", "b#0", "b#1"]
    for tokens, finish in results.values():
        assert re.fullmatch(pattern, text_of(tok, tokens)) and finish == FinishReason.STOP
