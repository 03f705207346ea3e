"""Preemption by recompute, step by step, against schedules worked out by hand (block size 4).

The fake worker samples `1000 + len(tokens)` unless a test scripts its tokens, so an output token
tells at which sequence length it was sampled.
"""

from __future__ import annotations

from engine.outputs import FinishReason
from engine.sched.request import RequestStatus, SequenceStatus
from tests.unit.scheduler_helpers import (
    collect,
    make_request,
    outputs_by_id,
    run_until_done,
    scheduler_and_worker,
    step,
    two_growing_requests,
)
from tests.unit.scheduler_invariants import (
    assert_all_free,
    held_blocks,
)

setup = scheduler_and_worker
by_id = outputs_by_id

# ---- preemption by recompute ----------------------------------------------------------------------


def test_latest_request_is_preempted_and_recomputed_later():
    scheduler, worker, a, b = two_growing_requests()
    tokens = {"a": list(a.seqs[0].output_token_ids), "b": list(b.seqs[0].output_token_ids)}
    reasons: dict = {}
    assert tokens["b"] == [1006, 1007, 1008]

    out, outputs = step(scheduler, worker)
    # a needs a third block: b (same priority, later arrival) is preempted, its blocks freed.
    assert out.num_scheduled_tokens == {"a": 1}
    assert out.finished_seq_ids == ["b"]  # the workers drop b's state
    assert b.status == RequestStatus.PREEMPTED and b.seqs[0].num_computed_tokens == 0
    assert b.seqs[0].output_token_ids == [1006, 1007, 1008]  # recompute keeps what was generated
    assert (scheduler.num_preemptions, a.num_preemptions, b.num_preemptions) == (1, 0, 1)
    assert [r.request_id for r in scheduler.waiting] == ["b"] and scheduler.running == [a]
    assert held_blocks(scheduler) == {"a": [0, 1, 3]}  # b's tail block (3) was freed first, reused first
    assert outputs.scheduler_stats.num_preemptions == 1
    collect(outputs, tokens, reasons)

    # b does not fit again until a finishes (only b's head block is free, and b needs 3 blocks).
    readmitted = None
    while scheduler.has_unfinished_requests():
        out, outputs = step(scheduler, worker)
        collect(outputs, tokens, reasons)
        for new in out.scheduled_new_seqs:
            assert new.seq_id == "b" and readmitted is None
            readmitted = new
            assert "a" in reasons  # a finished first
            assert out.num_scheduled_tokens == {"b": 9}  # the 9 known tokens, recomputed
    assert readmitted is not None
    assert readmitted.output_token_ids == [1006, 1007, 1008]
    assert readmitted.prompt_token_ids == list(range(11, 17))
    # a took b's head block at its 13th token, so nothing of b was left to hit.
    assert readmitted.num_computed_tokens == 0
    assert tokens == {
        "a": [1006, 1007, 1008, 1009, 1010, 1011, 1012, 1013],
        "b": [1006, 1007, 1008, 1009, 1010, 1011, 1012, 1013],
    }
    assert b.seqs[0].output_token_ids == tokens["b"]
    assert reasons == {"a": FinishReason.LENGTH, "b": FinishReason.LENGTH}
    assert scheduler.num_preemptions == 1
    assert_all_free(scheduler)


def test_lower_priority_is_preempted_before_an_earlier_arrival():
    scheduler, worker, a, b = two_growing_requests(priority_a=1, priority_b=0)
    out, _ = step(scheduler, worker)
    # b outranks a (lower number), so a goes although it arrived first.
    assert out.num_scheduled_tokens == {"b": 1}
    assert out.finished_seq_ids == ["a"]
    assert (a.status, a.num_preemptions, b.num_preemptions) == (RequestStatus.PREEMPTED, 1, 0)
    run_until_done(scheduler, worker)
    assert a.seqs[0].num_output_tokens == b.seqs[0].num_output_tokens == 8
    assert_all_free(scheduler)


def test_no_waiting_request_is_admitted_in_a_step_that_preempted():
    scheduler, worker, _a, b = two_growing_requests()
    # Urgent and tiny: it would fit in the block b's preemption frees, but must wait a step.
    urgent = make_request("urgent", [42, 43], max_tokens=1, arrival_time=5.0, priority=-1)
    scheduler.add_request(urgent)
    out, _ = step(scheduler, worker)
    assert out.num_scheduled_tokens == {"a": 1} and out.scheduled_new_seqs == []
    assert b.status == RequestStatus.PREEMPTED
    assert scheduler.kv_cache_manager.num_free_blocks == 1
    out, outputs = step(scheduler, worker)
    assert out.num_scheduled_tokens == {"a": 1, "urgent": 2}
    assert by_id(outputs)["urgent"].finish_reason == FinishReason.LENGTH
    run_until_done(scheduler, worker)
    assert_all_free(scheduler)


def test_request_preempts_itself_when_it_is_the_lowest_priority():
    scheduler, worker = setup(num_blocks=4)
    x = make_request("x", range(1, 6), max_tokens=6, priority=0)  # 5 tokens: room until position 7
    y = make_request("y", range(11, 19), max_tokens=6, priority=1)  # 8 tokens: both blocks full
    scheduler.add_request(x)
    scheduler.add_request(y)
    out, _ = step(scheduler, worker)
    assert out.num_scheduled_tokens == {"x": 5, "y": 8}
    assert held_blocks(scheduler) == {"x": [0, 1], "y": [2, 3]}
    out, _ = step(scheduler, worker)
    # y needs a third block and is itself the last running request: it is the victim.
    assert out.num_scheduled_tokens == {"x": 1} and out.finished_seq_ids == ["y"]
    assert y.status == RequestStatus.PREEMPTED and y.num_preemptions == 1
    assert scheduler.running == [x]
    readmitted = None
    while scheduler.has_unfinished_requests():
        out, _ = step(scheduler, worker)
        if out.scheduled_new_seqs:
            (readmitted,) = out.scheduled_new_seqs
            assert out.num_scheduled_tokens == {"y": 5}
    # x took y's tail block (3) at its 9th token; y's head block (2) was still cached.
    assert readmitted is not None
    assert (readmitted.num_computed_tokens, readmitted.block_ids) == (4, [2, 3, 1])
    assert x.seqs[0].num_output_tokens == 6 and y.seqs[0].num_output_tokens == 6
    assert_all_free(scheduler)


def test_preempted_request_reuses_its_cached_prefix():
    scheduler, worker = setup(num_blocks=5)
    a = make_request("a", range(1, 9), max_tokens=2, priority=0)  # 8 tokens: 2 full blocks
    b = make_request("b", range(11, 19), max_tokens=3, priority=1)  # 8 tokens: 2 full blocks
    scheduler.add_request(a)
    scheduler.add_request(b)
    out, _ = step(scheduler, worker)  # a: [0, 1], b: [2, 3], block 4 free
    assert out.num_scheduled_tokens == {"a": 8, "b": 8}
    out, _ = step(scheduler, worker)  # a takes block 4; b then finds none and preempts itself
    assert out.num_scheduled_tokens == {"a": 1}
    assert b.status == RequestStatus.PREEMPTED
    assert a.is_finished and a.seqs[0].status == SequenceStatus.FINISHED_LENGTH_CAPPED
    out, _ = step(scheduler, worker)
    (new,) = out.scheduled_new_seqs
    # b has 9 tokens; both of its full blocks are hits, only the sampled token is recomputed.
    assert (new.seq_id, new.num_computed_tokens, new.block_ids) == ("b", 8, [2, 3, 4])
    assert out.num_scheduled_tokens == {"b": 1}
    assert b.num_cached_tokens == 0  # reported to the user from the first admission only
    run_until_done(scheduler, worker)
    assert b.seqs[0].output_token_ids == [1008, 1009, 1010]
    assert_all_free(scheduler)
