"""Scheduler: how requests end — stop conditions (EOS, stop token ids, max_tokens, min_tokens,
max_model_len, the cache's end) and aborts — against schedules worked out by hand (block size 4).

The fake worker samples `1000 + len(tokens)` unless a test scripts its tokens.
"""

from __future__ import annotations

from engine.outputs import FinishReason
from engine.sched.request import RequestStatus, SequenceStatus
from tests.unit.scheduler_helpers import (
    FakeWorker,
    make_request,
    make_scheduler,
    outputs_by_id,
    run_until_done,
    scheduler_and_worker,
    scripted,
    step,
    two_growing_requests,
)
from tests.unit.scheduler_invariants import (
    assert_all_free,
    check_invariants,
    held_blocks,
)

setup = scheduler_and_worker
by_id = outputs_by_id


# ---- stop conditions ------------------------------------------------------------------------------


def run_scripted(request, script):
    scheduler = make_scheduler(num_blocks=32)
    worker = FakeWorker(
        4, scripted({request.request_id: script}, {request.request_id: request.num_prompt_tokens}), scheduler
    )
    scheduler.add_request(request)
    tokens, reasons = run_until_done(scheduler, worker)
    assert_all_free(scheduler)
    return tokens[request.request_id], reasons[request.request_id]


def test_eos_stops_with_the_eos_token_included():
    request = make_request("a", [1, 2, 3], eos_token_id=7, max_tokens=10)
    assert run_scripted(request, [5, 6, 7, 8, 9]) == ([5, 6, 7], FinishReason.STOP)
    assert request.seqs[0].stop_reason is None and request.seqs[0].status == SequenceStatus.FINISHED_STOPPED


def test_ignore_eos_runs_to_max_tokens():
    request = make_request("a", [1, 2, 3], eos_token_id=7, max_tokens=4, ignore_eos=True)
    assert run_scripted(request, [7, 7, 7, 7, 7]) == ([7, 7, 7, 7], FinishReason.LENGTH)


def test_stop_token_id_stops_and_is_the_stop_reason():
    request = make_request("a", [1, 2, 3], eos_token_id=7, stop_token_ids=[9, 8], max_tokens=10)
    assert run_scripted(request, [5, 8, 6, 6]) == ([5, 8], FinishReason.STOP)
    assert request.seqs[0].stop_reason == 8


def test_stop_token_ids_apply_even_with_ignore_eos():
    request = make_request("a", [1], eos_token_id=7, stop_token_ids=[9], max_tokens=10, ignore_eos=True)
    assert run_scripted(request, [7, 9, 7]) == ([7, 9], FinishReason.STOP)
    assert request.seqs[0].stop_reason == 9


def test_max_tokens_stops_with_length():
    request = make_request("a", [1, 2], max_tokens=2)
    assert run_scripted(request, [4, 5, 6]) == ([4, 5], FinishReason.LENGTH)
    assert request.seqs[0].stop_reason is None


def test_eos_on_the_last_position_the_cache_holds_is_a_stop():
    scheduler = make_scheduler(num_blocks=2)  # 8 tokens: the sequence ends there either way
    request = make_request("a", range(6), eos_token_id=7, max_tokens=10)
    worker = FakeWorker(4, scripted({"a": [5, 7]}, {"a": 6}), scheduler)
    scheduler.add_request(request)
    tokens, reasons = run_until_done(scheduler, worker)
    assert (tokens, reasons) == ({"a": [5, 7]}, {"a": FinishReason.STOP})
    assert request.seqs[0].status == SequenceStatus.FINISHED_STOPPED


def test_min_tokens_does_not_hold_a_sequence_past_the_cache():
    scheduler = make_scheduler(num_blocks=2)
    request = make_request("a", range(6), eos_token_id=7, max_tokens=10, min_tokens=5)
    worker = FakeWorker(4, scripted({"a": [7, 7]}, {"a": 6}), scheduler)
    scheduler.add_request(request)
    tokens, reasons = run_until_done(scheduler, worker)
    assert (tokens, reasons) == ({"a": [7, 7]}, {"a": FinishReason.LENGTH})
    assert_all_free(scheduler)


def test_no_eos_token_and_no_max_tokens_runs_to_max_model_len():
    scheduler, worker = setup(num_blocks=100, max_model_len=10)
    scheduler.add_request(make_request("a", range(3), max_tokens=None, eos_token_id=None))
    tokens, reasons = run_until_done(scheduler, worker)
    assert len(tokens["a"]) == 7 and reasons["a"] == FinishReason.LENGTH


# ---- aborts ---------------------------------------------------------------------------------------


def test_abort_running_request_frees_its_blocks_at_once():
    scheduler, worker = setup(num_blocks=8)
    a = make_request("a", range(10), max_tokens=10)
    scheduler.add_request(a)
    step(scheduler, worker)
    assert scheduler.kv_cache_manager.num_free_blocks == 5
    scheduler.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    assert a.status == RequestStatus.FINISHED_ABORTED and a.is_finished
    assert a.seqs[0].status == SequenceStatus.FINISHED_ABORTED
    assert_all_free(scheduler)
    assert not scheduler.has_unfinished_requests()
    out, outputs = step(scheduler, worker)
    assert out.finished_seq_ids == ["a"] and out.num_scheduled_tokens == {}
    assert outputs.outputs == []


def test_abort_waiting_and_preempted_requests():
    scheduler, worker, a, b = two_growing_requests()
    step(scheduler, worker)  # b preempted, back in the waiting queue
    c = make_request("c", [1, 2, 3], arrival_time=9.0)
    scheduler.add_request(c)
    scheduler.finish_requests(["b", "c"], RequestStatus.FINISHED_ABORTED)
    assert b.status == c.status == RequestStatus.FINISHED_ABORTED
    assert b.seqs[0].status == c.seqs[0].status == SequenceStatus.FINISHED_ABORTED
    assert scheduler.waiting == [] and scheduler.running == [a]
    check_invariants(scheduler)
    _tokens, reasons = run_until_done(scheduler, worker)
    assert set(reasons) == {"a"}  # b and c never come back
    assert_all_free(scheduler)


def test_abort_unknown_finished_and_repeated_ids_are_no_ops():
    scheduler, worker = setup(num_blocks=8)
    a = make_request("a", range(3), max_tokens=1)
    b = make_request("b", range(3), max_tokens=5, arrival_time=1.0)
    scheduler.add_request(a)
    scheduler.add_request(b)
    step(scheduler, worker)
    assert a.is_finished and a.seqs[0].status == SequenceStatus.FINISHED_LENGTH_CAPPED
    a_status = a.status
    scheduler.finish_requests(["nope", "a", "b", "b"], RequestStatus.FINISHED_ABORTED)
    # Finished stays finished.
    assert a.status == a_status and a.seqs[0].status == SequenceStatus.FINISHED_LENGTH_CAPPED
    assert b.status == RequestStatus.FINISHED_ABORTED
    scheduler.finish_requests(["a", "b"], RequestStatus.FINISHED_ABORTED)
    assert_all_free(scheduler)


def test_abort_between_schedule_and_update_drops_the_sampled_token():
    scheduler, worker = setup(num_blocks=8)
    a = make_request("a", range(4), max_tokens=5, arrival_time=0)
    b = make_request("b", range(10, 14), max_tokens=5, arrival_time=1)
    scheduler.add_request(a)
    scheduler.add_request(b)
    out = scheduler.schedule().scheduler_output
    runner_output = worker.execute(out)
    assert sorted(runner_output.seq_ids) == ["a", "b"]
    scheduler.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    outputs = scheduler.update_from_output(out, runner_output)
    assert [o.request_id for o in outputs.outputs] == ["b"]
    assert a.seqs[0].output_token_ids == [] and held_blocks(scheduler) == {"b": [1]}
    check_invariants(scheduler)
    run_until_done(scheduler, worker)
    assert_all_free(scheduler)


def test_abort_one_of_two_requests_sharing_a_prefix_keeps_the_shared_blocks():
    scheduler, worker = setup(num_blocks=8)
    scheduler.add_request(make_request("a", range(9), max_tokens=5, arrival_time=0))
    step(scheduler, worker)
    scheduler.add_request(make_request("b", [*range(8), 77], max_tokens=5, arrival_time=1))
    step(scheduler, worker)
    assert held_blocks(scheduler) == {"a": [0, 1, 2], "b": [0, 1, 3]}
    scheduler.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    assert held_blocks(scheduler) == {"b": [0, 1, 3]}
    refs = [blk.ref_cnt for blk in scheduler.kv_cache_manager.block_pool.blocks]
    assert refs == [1, 1, 0, 1, 0, 0, 0, 0]
    check_invariants(scheduler)
    run_until_done(scheduler, worker)
    assert_all_free(scheduler)
