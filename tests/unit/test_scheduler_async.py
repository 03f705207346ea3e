"""Async scheduling, the protocol: placeholders filled by the worker, stops and limits one step
late, and what runs in plain steps instead; random workloads against the synchronous scheduler.

The harness (`AsyncCore`, `compare`) is in tests/unit/scheduler_async_core.py; preemption, forks
and requests finished mid-flight are in test_scheduler_async_preemption.py.
"""

from __future__ import annotations

from concurrent.futures import Future

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.config import CacheConfig, SchedulerConfig
from engine.outputs import FinishReason
from engine.sched.request import Request, RequestStatus
from engine.sched.scheduler import Scheduler
from engine.spec_decode.config import SpeculativeConfig
from tests.unit.scheduler_async_core import (
    AsyncCore,
    compare,
    computed_per_seq,
    counting,
    record,
    run_sync,
    without_requests,
)
from tests.unit.scheduler_helpers import collect, make_beam_request, make_request, scheduler_and_worker
from tests.unit.scheduler_invariants import assert_all_free, check_invariants, held_blocks
from tests.unit.scheduler_scenarios import (
    Scenario,
    build_request,
    group_scenarios,
    pressured_scenarios,
    scenarios,
    token_fn,
)

# ---- plain decoding -----------------------------------------------------------------------------


def test_plain_decode_matches_sync_with_the_same_steps(worker_runs):
    def requests():
        return [
            make_request("a", range(1, 4), max_tokens=5),
            make_request("b", range(11, 17), max_tokens=8),
            make_request("c", range(21, 30), max_tokens=1),
        ]

    (tokens, reasons, steps, _), core = compare(requests, worker_runs, num_blocks=32)
    assert tokens == {"a": counting(3, 5), "b": counting(6, 8), "c": counting(9, 1)}
    assert set(reasons.values()) == {FinishReason.LENGTH}
    assert core.num_ahead > 0  # it did plan steps ahead
    # Placeholders let each decode be planned early, not twice: the same steps, the same tokens.
    assert [out.num_scheduled_tokens for out in core.steps] == [out.num_scheduled_tokens for out in steps]


def test_max_tokens_and_the_length_limit_are_exact(worker_runs):
    def requests():
        return [
            make_request("one", range(1, 6), max_tokens=1),
            make_request("two", range(31, 36), max_tokens=2),
            make_request("three", range(11, 16), max_tokens=3),
            make_request("open", range(21, 27), max_tokens=None),  # stops at max_model_len
        ]

    (tokens, reasons, steps, _), core = compare(requests, worker_runs, num_blocks=32, max_model_len=16)
    assert {key: len(value) for key, value in tokens.items()} == {"one": 1, "two": 2, "three": 3, "open": 10}
    assert set(reasons.values()) == {FinishReason.LENGTH}
    # Every position but the last token's computed once, none beyond (no placeholder past the end).
    computed = computed_per_seq(core.steps)
    assert computed == {"one": 5, "two": 6, "three": 7, "open": 15} == computed_per_seq(steps)


def test_chunked_prefill_under_a_small_budget(worker_runs):
    def requests():
        return [
            make_request("a", range(1, 12), max_tokens=6),
            make_request("b", range(31, 38), max_tokens=5),
            make_request("c", range(51, 54), max_tokens=4),
        ]

    (tokens, _, steps, _), core = compare(requests, worker_runs, num_blocks=32, max_num_batched_tokens=5)
    assert tokens == {"a": counting(11, 6), "b": counting(7, 5), "c": counting(3, 4)}
    assert max(out.total_num_scheduled_tokens for out in core.steps) == 5
    assert computed_per_seq(core.steps) == computed_per_seq(steps)


def test_eos_stops_one_step_late_and_frees_every_block_once_that_step_returns(worker_runs):
    eos = 7

    def token_fn(seq_id: str, tokens: list[int]) -> int:
        return eos if seq_id == "e" and len(tokens) == 9 else 1000 + len(tokens)

    def requests():
        return [
            make_request("e", range(1, 7), max_tokens=10, eos_token_id=eos),
            make_request("f", range(11, 15), max_tokens=8, eos_token_id=eos),
        ]

    (tokens, reasons, steps, _), core = compare(requests, worker_runs, token_fn, num_blocks=16)
    assert tokens["e"] == [1006, 1007, 1008, eos] and reasons["e"] == FinishReason.STOP
    assert tokens["f"] == counting(4, 8) and reasons["f"] == FinishReason.LENGTH
    # The step after the one that sampled EOS was planned before EOS was known: one placeholder more.
    assert computed_per_seq(core.steps)["e"] == computed_per_seq(steps)["e"] + 1
    assert computed_per_seq(core.steps)["f"] == computed_per_seq(steps)["f"]


def test_blocks_of_a_stopped_sequence_are_freed_while_its_placeholder_step_runs(worker_runs):
    eos = 7
    scheduler, worker = scheduler_and_worker(
        lambda seq_id, tokens: eos if len(tokens) == 6 else 1000 + len(tokens),
        async_scheduling=True,
        num_blocks=8,
    )
    core = AsyncCore(scheduler, worker, worker_runs)
    scheduler.add_request(make_request("e", range(1, 5), max_tokens=10, eos_token_id=eos))
    while "e" not in core.reasons:
        collect(core.step(), core.tokens, core.reasons)
    assert core.tokens["e"] == [1004, 1005, eos]
    # The step planned on EOS as a placeholder is still in flight, yet nothing is held any more.
    (in_flight, _) = core.queue[0]
    assert "e" in in_flight.num_scheduled_tokens
    assert held_blocks(scheduler) == {} and scheduler.make_stats().kv_cache_usage == 0.0
    core.run()
    assert_all_free(scheduler)
    assert core.tokens["e"] == [1004, 1005, eos]  # its in-flight sample was never reported


# ---- requests that need their tokens before the next step ---------------------------------------


class AnyTokenMatcher:
    """A grammar that allows every token and never completes (the fake worker samples unmasked)."""

    def accept_token(self, token_id: int) -> None:
        pass

    def fork(self) -> AnyTokenMatcher:
        return AnyTokenMatcher()

    def is_terminated(self) -> bool:
        return False

    def error(self) -> str | None:
        return None


class AnyTokenGrammar:
    def new_matcher(self) -> AnyTokenMatcher:
        return AnyTokenMatcher()


def with_grammar(request: Request) -> Request:
    compiled: Future = Future()
    compiled.set_result(AnyTokenGrammar())
    request.grammar = compiled
    return request


@pytest.mark.parametrize("kind", ["beam", "grammar"])
def test_beam_search_and_grammars_run_in_plain_steps(worker_runs, kind):
    def special() -> Request:
        if kind == "beam":
            return make_beam_request("s", range(41, 46), beam_width=2, max_tokens=4)
        return with_grammar(make_request("s", range(41, 46), max_tokens=4))

    def requests():
        return [
            make_request("a", range(1, 5), max_tokens=10),
            make_request("b", range(11, 14), max_tokens=3),
            special(),
        ]

    (tokens, _, _, sync_scheduler), core = compare(requests, worker_runs, num_blocks=32)
    assert not sync_scheduler.may_schedule_ahead()  # never without async scheduling
    assert tokens["a"] == counting(4, 10) and tokens["b"] == counting(3, 3)
    # AsyncCore.check_scheduled saw every step that ran `s` planned with nothing else in flight.
    assert core.num_ahead > 0  # the others ran ahead once `s` was done

    scheduler, worker = scheduler_and_worker(async_scheduling=True, num_blocks=32)
    core = AsyncCore(scheduler, worker, worker_runs)
    scheduler.add_request(make_request("a", range(1, 5), max_tokens=10))
    collect(core.step(), core.tokens, core.reasons)
    assert scheduler.may_schedule_ahead()
    scheduler.add_request(special())
    assert scheduler.may_schedule_ahead()  # waiting, not running yet
    collect(core.step(), core.tokens, core.reasons)  # admitted into a step planned ahead
    assert scheduler.requests["s"].status == RequestStatus.RUNNING
    assert not scheduler.may_schedule_ahead()
    core.run()
    assert_all_free(scheduler)


def test_speculative_decoding_turns_placeholders_off():
    scheduler = Scheduler(
        SchedulerConfig(),
        CacheConfig(block_size=4),
        num_kv_blocks=16,
        max_model_len=64,
        speculative_config=SpeculativeConfig(method="ngram", num_speculative_tokens=2),
        async_scheduling=True,
    )
    assert not scheduler.async_scheduling and not scheduler.may_schedule_ahead()
    scheduler.add_request(make_request("a", range(1, 5)))
    out = scheduler.schedule().scheduler_output
    assert out.num_scheduled_tokens == {"a": 4}
    assert scheduler.requests["a"].seqs[0].num_pending_tokens == 0


# ---- random workloads ---------------------------------------------------------------------------


def scenario_settings(sc: Scenario) -> dict:
    return {
        "num_blocks": sc.num_blocks,
        "block_size": sc.block_size,
        "max_num_seqs": sc.max_num_seqs,
        "max_num_batched_tokens": sc.max_num_batched_tokens,
        "max_model_len": sc.max_model_len,
        "enable_prefix_caching": sc.enable_prefix_caching,
        "num_cpu_blocks": sc.num_cpu_blocks,
        "preemption_mode": sc.preemption_mode,
    }


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.one_of(
        scenarios(spare_cache_tokens=24, max_requests=8, max_prompt=16),
        pressured_scenarios(),
        group_scenarios(fits_alone=True),
        group_scenarios(fits_alone=False),
    ),
    st.sampled_from(["schedule", "update"]),
)
def test_random_workloads_give_the_synchronous_outputs(sc: Scenario, worker_runs: str):
    """Plain, parallel-sampling and beam requests in small caches (preemption by recompute and swap,
    chunking, prefix hits), arriving over several steps, some aborted or stopped between steps or
    while two steps are in flight: every request that ran to its end gives the synchronous outputs.
    (Aborted, stopped and cut-short requests are left out: the others' outputs do not depend on them.)"""
    sync_scheduler, sync_worker = scheduler_and_worker(token_fn, **scenario_settings(sc))
    for i, spec in enumerate(sc.specs):
        sync_scheduler.add_request(build_request(spec, f"r{i}", i / 100))
    left_out: set[str] = set()
    expected, expected_reasons, _ = run_sync(sync_scheduler, sync_worker, left_out)

    scheduler, worker = scheduler_and_worker(token_fn, async_scheduling=True, **scenario_settings(sc))
    core = AsyncCore(scheduler, worker, worker_runs)

    def finish_early(step_index: int, mid_step: bool) -> None:
        for i, spec in enumerate(sc.specs):
            request_id = f"r{i}"
            if request_id not in scheduler.requests:
                continue
            if (spec.abort_step, spec.abort_mid_step) == (step_index, mid_step):
                scheduler.finish_requests([request_id], RequestStatus.FINISHED_ABORTED)
                finished = request_id
            elif spec.stop is not None and (spec.stop[0], spec.stop[2]) == (step_index, mid_step):
                scheduler.stop_sequence(request_id, spec.stop[1], "stop!")
                finished = f"{request_id}#{spec.stop[1]}" if spec.stop[1] else request_id
            else:
                continue
            left_out.add(request_id)
            check_invariants(scheduler)
            assert finished not in held_blocks(scheduler) and finished not in scheduler.groups.seqs

    for step_index in range(500):
        for i, spec in enumerate(sc.specs):
            if spec.arrival_step == step_index:
                scheduler.add_request(build_request(spec, f"r{i}", i / 100))
        finish_early(step_index, mid_step=False)
        arrived = step_index >= max(spec.arrival_step for spec in sc.specs)
        if arrived and not scheduler.has_unfinished_requests() and not core.queue:
            break
        outputs = core.step(lambda index=step_index: finish_early(index, mid_step=True))
        record(outputs, core.tokens, core.reasons, core.cut_short)
    else:
        raise AssertionError("the run does not end")
    assert_all_free(scheduler)
    left_out |= core.cut_short
    assert without_requests(core.tokens, left_out) == without_requests(expected, left_out)
    assert without_requests(core.reasons, left_out) == without_requests(expected_reasons, left_out)
