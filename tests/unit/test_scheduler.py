"""Scheduler, step by step, against schedules worked out by hand (block size 4 throughout).

The fake worker samples `1000 + len(tokens)` unless a test scripts its tokens, so an output token
tells at which sequence length it was sampled.
"""

from __future__ import annotations

import pytest

from engine.outputs import FinishReason, ModelRunnerOutput
from engine.request import RequestStatus, SequenceStatus
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


# ---- one request ----------------------------------------------------------------------------------


def test_single_request_prefill_then_decode_then_length_stop():
    scheduler, worker = setup(num_blocks=8)
    request = make_request("a", range(10), max_tokens=3)
    scheduler.add_request(request)
    assert scheduler.has_unfinished_requests() and scheduler.get_num_unfinished_requests() == 1

    out, outputs = step(scheduler, worker)
    assert out.num_scheduled_tokens == {"a": 10} and out.total_num_scheduled_tokens == 10
    (new,) = out.scheduled_new_seqs
    assert (new.seq_id, new.block_ids, new.num_computed_tokens) == ("a", [0, 1, 2], 0)
    assert new.prompt_token_ids == list(range(10)) and new.output_token_ids == []
    assert out.scheduled_cached_seqs.seq_ids == []
    assert [(o.request_id, o.new_token_ids, o.finished) for o in outputs.outputs] == [("a", [1010], False)]
    assert request.status == RequestStatus.RUNNING

    out, outputs = step(scheduler, worker)
    assert out.num_scheduled_tokens == {"a": 1} and out.scheduled_new_seqs == []
    cached = out.scheduled_cached_seqs
    # Only the delta goes out: the token sampled last step, no new block (position 10 is in block 2),
    # so the block table changes from its end (index 3) on by nothing.
    assert (
        cached.seq_ids,
        cached.new_token_ids,
        cached.block_table_starts,
        cached.new_block_ids,
        cached.num_computed_tokens,
    ) == (["a"], [[1010]], [3], [[]], [10])
    assert by_id(outputs)["a"].new_token_ids == [1011]

    out, outputs = step(scheduler, worker)
    assert out.num_scheduled_tokens == {"a": 1}
    final = by_id(outputs)["a"]
    assert final.new_token_ids == [1012] and final.finish_reason == FinishReason.LENGTH
    (seq,) = request.seqs
    assert seq.status == SequenceStatus.FINISHED_LENGTH_CAPPED and request.is_finished
    assert seq.output_token_ids == [1010, 1011, 1012]
    # Blocks come back as soon as the request finishes, before any further step.
    assert_all_free(scheduler)
    assert not scheduler.has_unfinished_requests()
    # The workers hear about it in the next step's output, once.
    assert scheduler.schedule().scheduler_output.finished_seq_ids == ["a"]
    assert scheduler.schedule().scheduler_output.finished_seq_ids == []


def test_decode_crossing_a_block_boundary_sends_the_new_block():
    scheduler, worker = setup(num_blocks=8)
    scheduler.add_request(make_request("a", range(4), max_tokens=3))
    out, _ = step(scheduler, worker)
    assert out.scheduled_new_seqs[0].block_ids == [0]
    out, _ = step(scheduler, worker)  # position 4 opens block 1
    assert out.scheduled_cached_seqs.new_block_ids == [[1]]
    assert out.scheduled_cached_seqs.block_table_starts == [1]  # appended after block 0
    assert out.scheduled_cached_seqs.num_computed_tokens == [4]


def test_duplicate_request_id_is_rejected():
    scheduler, _ = setup(num_blocks=4)
    scheduler.add_request(make_request("a", [1, 2]))
    with pytest.raises(ValueError, match="already in use"):
        scheduler.add_request(make_request("a", [3]))


# ---- chunked prefill and the token budget ---------------------------------------------------------


def test_long_prompt_is_spread_over_several_steps():
    scheduler, worker = setup(num_blocks=8, max_num_batched_tokens=4)
    scheduler.add_request(make_request("a", range(10), max_tokens=2))
    out, outputs = step(scheduler, worker)
    assert out.num_scheduled_tokens == {"a": 4} and out.scheduled_new_seqs[0].block_ids == [0]
    assert outputs.outputs == []  # mid-prefill: nothing sampled
    out, outputs = step(scheduler, worker)
    assert out.num_scheduled_tokens == {"a": 4}
    assert out.scheduled_cached_seqs.new_block_ids == [[1]]
    assert out.scheduled_cached_seqs.block_table_starts == [1]
    assert out.scheduled_cached_seqs.new_token_ids == [[]]
    assert outputs.outputs == []
    out, outputs = step(scheduler, worker)
    assert out.num_scheduled_tokens == {"a": 2}
    assert by_id(outputs)["a"].new_token_ids == [1010]
    out, outputs = step(scheduler, worker)
    assert out.num_scheduled_tokens == {"a": 1}
    assert by_id(outputs)["a"].finish_reason == FinishReason.LENGTH
    assert_all_free(scheduler)


def test_decodes_and_a_prefill_chunk_share_a_step():
    scheduler, worker = setup(num_blocks=16, max_num_batched_tokens=8)
    scheduler.add_request(make_request("a", range(3), max_tokens=10))
    out, _ = step(scheduler, worker)
    assert out.num_scheduled_tokens == {"a": 3}
    scheduler.add_request(make_request("b", range(100, 120), max_tokens=2, arrival_time=1.0))
    plan = []
    for _ in range(4):
        out, outputs = step(scheduler, worker)
        plan.append((out.num_scheduled_tokens, sorted(o.request_id for o in outputs.outputs)))
    assert plan == [
        ({"a": 1, "b": 7}, ["a"]),  # the running decode first, the new prompt gets what is left
        ({"a": 1, "b": 7}, ["a"]),
        ({"a": 1, "b": 6}, ["a", "b"]),  # b's last chunk samples its first token
        ({"a": 1, "b": 1}, ["a", "b"]),
    ]


def test_budget_is_shared_in_order_and_never_exceeded():
    scheduler, worker = setup(num_blocks=16, max_num_batched_tokens=5)
    for i, name in enumerate("abc"):
        scheduler.add_request(make_request(name, range(10 * i, 10 * i + 4), max_tokens=4, arrival_time=i))
    out, _ = step(scheduler, worker)
    assert out.num_scheduled_tokens == {"a": 4, "b": 1}  # c waits: the budget is spent
    assert [r.request_id for r in scheduler.waiting] == ["c"]
    out, _ = step(scheduler, worker)
    assert out.num_scheduled_tokens == {"a": 1, "b": 3, "c": 1}
    out, _ = step(scheduler, worker)
    assert out.num_scheduled_tokens == {"a": 1, "b": 1, "c": 3}
    _tokens, reasons = run_until_done(scheduler, worker)
    assert set(reasons) == {"a", "b", "c"}
    assert_all_free(scheduler)


def test_max_num_seqs_caps_the_batch():
    scheduler, worker = setup(num_blocks=16, max_num_seqs=2)
    scheduler.add_request(make_request("a", range(3), max_tokens=1, arrival_time=0))
    scheduler.add_request(make_request("b", range(10, 13), max_tokens=3, arrival_time=1))
    scheduler.add_request(make_request("c", range(20, 23), max_tokens=1, arrival_time=2))
    out, outputs = step(scheduler, worker)
    assert out.num_scheduled_tokens == {"a": 3, "b": 3}
    assert by_id(outputs)["a"].finished  # max_tokens=1: done after its prefill
    out, _ = step(scheduler, worker)
    assert out.num_scheduled_tokens == {"b": 1, "c": 3}  # a's seat went to c
    run_until_done(scheduler, worker)
    assert_all_free(scheduler)


# ---- order: FCFS and priority ---------------------------------------------------------------------


def test_fcfs_by_arrival_then_priority_lower_first():
    scheduler, worker = setup(num_blocks=16, max_num_seqs=1)
    scheduler.add_request(make_request("late", [1, 2], max_tokens=1, arrival_time=1.0))
    scheduler.add_request(make_request("early", [3, 4], max_tokens=1, arrival_time=0.0))
    scheduler.add_request(make_request("urgent", [5, 6], max_tokens=1, arrival_time=2.0, priority=-1))
    scheduler.add_request(make_request("lazy", [7, 8], max_tokens=1, arrival_time=-1.0, priority=3))
    order = []
    while scheduler.has_unfinished_requests():
        out, _ = step(scheduler, worker)
        order.extend(out.num_scheduled_tokens)
    assert order == ["urgent", "early", "late", "lazy"]
    assert_all_free(scheduler)


def test_waiting_head_that_does_not_fit_is_not_overtaken():
    scheduler, worker = setup(num_blocks=4, max_num_batched_tokens=64)
    scheduler.add_request(make_request("holder", range(8), max_tokens=3, arrival_time=0))
    step(scheduler, worker)  # holder: 2 blocks, 2 left
    scheduler.add_request(make_request("big", range(100, 112), max_tokens=1, arrival_time=1))  # 3 blocks
    scheduler.add_request(make_request("small", [7], max_tokens=1, arrival_time=2))  # would fit
    out, _ = step(scheduler, worker)
    assert out.num_scheduled_tokens == {"holder": 1}
    assert [r.request_id for r in scheduler.waiting] == ["big", "small"]
    _tokens, reasons = run_until_done(scheduler, worker)
    assert reasons == {
        "holder": FinishReason.LENGTH,
        "big": FinishReason.LENGTH,
        "small": FinishReason.LENGTH,
    }
    assert_all_free(scheduler)


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


# ---- prompts and requests that do not fit the cache -----------------------------------------------


def test_prompt_larger_than_the_cache_is_ignored_with_an_error():
    scheduler, worker = setup(num_blocks=2)  # 8 tokens of KV cache
    big = make_request("big", range(9), arrival_time=0)
    ok = make_request("ok", range(3), max_tokens=1, arrival_time=1)
    scheduler.add_request(big)
    scheduler.add_request(ok)
    out, outputs = step(scheduler, worker)
    assert out.num_scheduled_tokens == {"ok": 3}  # the queue moves on past the ignored prompt
    assert out.finished_seq_ids == []  # the workers never held it
    report = by_id(outputs)
    assert report["big"].new_token_ids == [] and report["big"].finish_reason == FinishReason.LENGTH
    assert "does not fit" in report["big"].error
    assert (
        big.status == RequestStatus.FINISHED_IGNORED and big.seqs[0].status == SequenceStatus.FINISHED_IGNORED
    )
    assert big.error
    assert "big" not in scheduler.requests
    assert report["ok"].finished and report["ok"].error is None
    assert_all_free(scheduler)
    assert scheduler.schedule().scheduler_output.finished_seq_ids == ["ok"]


def test_requests_finished_while_scheduling_are_reported_by_that_schedule_call():
    scheduler, _ = setup(num_blocks=2)  # 8 tokens of KV cache
    scheduler.add_request(make_request("big", range(9)))
    scheduled = scheduler.schedule()
    # Nothing for the workers, yet the step has news: the ignored request, reported once.
    assert scheduled.scheduler_output.total_num_scheduled_tokens == 0
    (report,) = scheduled.finished_outputs
    assert (report.request_id, report.finish_reason, report.request_finished) == (
        "big",
        FinishReason.LENGTH,
        True,
    )
    assert not scheduler.has_unfinished_requests()
    empty = ModelRunnerOutput(seq_ids=[], sampled_token_ids=[])
    assert scheduler.update_from_output(scheduled.scheduler_output, empty).outputs == []


def test_prompt_longer_than_max_model_len_is_ignored():
    scheduler, worker = setup(num_blocks=100, max_model_len=8)
    scheduler.add_request(make_request("long", range(9)))
    _, outputs = step(scheduler, worker)
    assert by_id(outputs)["long"].finish_reason == FinishReason.LENGTH
    assert by_id(outputs)["long"].error


def test_prompt_filling_the_whole_cache_runs_and_stops_at_its_first_token():
    scheduler, worker = setup(num_blocks=2)
    request = make_request("full", range(8), max_tokens=5)
    scheduler.add_request(request)
    _, outputs = step(scheduler, worker)
    assert by_id(outputs)["full"].new_token_ids == [1008]
    assert request.seqs[0].status == SequenceStatus.FINISHED_LENGTH_CAPPED and request.error is None
    assert_all_free(scheduler)


def test_running_request_that_outgrows_the_cache_is_length_capped():
    scheduler, worker = setup(num_blocks=2)  # 8 tokens
    request = make_request("grow", range(5), max_tokens=100)
    scheduler.add_request(request)
    tokens, reasons = run_until_done(scheduler, worker)
    assert tokens == {"grow": [1005, 1006, 1007]}  # 5 + 3 = 8 tokens: the cache is full
    assert reasons == {"grow": FinishReason.LENGTH}
    assert request.seqs[0].status == SequenceStatus.FINISHED_LENGTH_CAPPED and request.is_finished
    assert_all_free(scheduler)


def test_max_model_len_caps_generation():
    scheduler, worker = setup(num_blocks=100, max_model_len=6)
    scheduler.add_request(make_request("a", range(4), max_tokens=10))
    tokens, reasons = run_until_done(scheduler, worker)
    assert tokens == {"a": [1004, 1005]} and reasons == {"a": FinishReason.LENGTH}


# ---- prefix caching through the scheduler ---------------------------------------------------------


def test_second_request_with_a_shared_prefix_hits_the_cache_and_shares_blocks():
    scheduler, worker = setup(num_blocks=16)
    scheduler.add_request(make_request("a", range(10), max_tokens=5, arrival_time=0))
    step(scheduler, worker)
    b = make_request("b", [*range(8), 50, 51, 52], max_tokens=5, arrival_time=1)
    scheduler.add_request(b)
    out, outputs = step(scheduler, worker)
    (new,) = out.scheduled_new_seqs
    assert (new.seq_id, new.num_computed_tokens, new.block_ids) == ("b", 8, [0, 1, 3])
    assert out.num_scheduled_tokens == {"a": 1, "b": 3}
    assert b.num_cached_tokens == 8 and by_id(outputs)["b"].num_cached_tokens == 8
    pool = scheduler.kv_cache_manager.block_pool
    assert [blk.ref_cnt for blk in pool.blocks[:4]] == [2, 2, 1, 1]
    stats = outputs.scheduler_stats
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (10 + 11, 8)
    run_until_done(scheduler, worker)
    assert_all_free(scheduler)


def test_identical_prompt_recomputes_its_last_token():
    scheduler, worker = setup(num_blocks=16)
    scheduler.add_request(make_request("a", range(8), max_tokens=1))
    run_until_done(scheduler, worker)
    again = make_request("again", range(8), max_tokens=1)
    scheduler.add_request(again)
    out, outputs = step(scheduler, worker)
    assert out.num_scheduled_tokens == {"again": 4}  # block 0 hit; block 1 holds the last token
    assert again.num_cached_tokens == 4
    assert by_id(outputs)["again"].new_token_ids == [1008]
    assert_all_free(scheduler)


def test_prefix_caching_disabled_computes_everything():
    scheduler, worker = setup(num_blocks=16, enable_prefix_caching=False)
    scheduler.add_request(make_request("a", range(12), max_tokens=1))
    run_until_done(scheduler, worker)
    again = make_request("again", range(13), max_tokens=1)
    scheduler.add_request(again)
    out, outputs = step(scheduler, worker)
    assert out.num_scheduled_tokens == {"again": 13} and again.num_cached_tokens == 0
    assert by_id(outputs)["again"].num_cached_tokens == 0


def test_prefix_hit_on_a_block_computed_in_the_same_step():
    # b arrives with a; a's full blocks are published when they are scheduled, so b hits them.
    scheduler, worker = setup(num_blocks=16)
    scheduler.add_request(make_request("a", range(9), max_tokens=2, arrival_time=0))
    scheduler.add_request(make_request("b", range(9), max_tokens=2, arrival_time=1))
    out, _ = step(scheduler, worker)
    assert out.num_scheduled_tokens == {"a": 9, "b": 1}
    assert held_blocks(scheduler) == {"a": [0, 1, 2], "b": [0, 1, 3]}
    run_until_done(scheduler, worker)
    assert_all_free(scheduler)


# ---- stats and bookkeeping ------------------------------------------------------------------------


def test_stats_follow_the_queues_and_the_cache():
    scheduler, worker = setup(num_blocks=8, max_num_seqs=1)
    scheduler.add_request(make_request("a", range(6), max_tokens=2, arrival_time=0))
    scheduler.add_request(make_request("b", range(3), max_tokens=1, arrival_time=1))
    _, outputs = step(scheduler, worker)
    stats = outputs.scheduler_stats
    assert (stats.num_running_reqs, stats.num_waiting_reqs, stats.num_kv_blocks) == (1, 1, 8)
    assert stats.kv_cache_usage == 2 / 8
    assert (stats.kv_tokens_held, stats.kv_slots_allocated) == (6, 8)
    assert scheduler.get_num_unfinished_requests() == 2
    run_until_done(scheduler, worker)
    stats = scheduler.make_stats()
    assert (stats.num_running_reqs, stats.num_waiting_reqs, stats.kv_cache_usage) == (0, 0, 0.0)


def test_reset_prefix_cache_waits_until_no_request_holds_blocks():
    scheduler, worker = setup(num_blocks=8)
    scheduler.add_request(make_request("a", range(9), max_tokens=2))
    step(scheduler, worker)
    assert scheduler.reset_prefix_cache() is False  # "a" still holds its blocks
    run_until_done(scheduler, worker)
    scheduler.add_request(make_request("b", range(9), max_tokens=1))
    out, _ = step(scheduler, worker)
    assert out.scheduled_new_seqs[0].num_computed_tokens == 8  # "a"'s prefix is cached
    run_until_done(scheduler, worker)
    assert scheduler.reset_prefix_cache() is True
    scheduler.add_request(make_request("c", range(9), max_tokens=1))
    out, _ = step(scheduler, worker)
    assert out.scheduled_new_seqs[0].num_computed_tokens == 0  # forgotten
    run_until_done(scheduler, worker)
    assert_all_free(scheduler)


def test_update_with_nothing_sampled_changes_nothing():
    scheduler, _ = setup(num_blocks=8, max_num_batched_tokens=2)
    request = make_request("a", range(5))
    scheduler.add_request(request)
    out = scheduler.schedule().scheduler_output
    outputs = scheduler.update_from_output(out, ModelRunnerOutput(seq_ids=[], sampled_token_ids=[]))
    assert outputs.outputs == [] and request.seqs[0].output_token_ids == []
    assert request.seqs[0].num_computed_tokens == 2 and request.status == RequestStatus.RUNNING


def test_many_requests_all_finish_and_free_everything():
    scheduler, worker = setup(num_blocks=6, max_num_batched_tokens=7, max_num_seqs=3)
    for i in range(8):
        prompt = [*range(4), *range(100 * i, 100 * i + i + 1)]  # a shared first block
        scheduler.add_request(make_request(f"r{i}", prompt, max_tokens=1 + i % 4, arrival_time=i))
    tokens, reasons = run_until_done(scheduler, worker)
    assert {r: len(t) for r, t in tokens.items()} == {f"r{i}": 1 + i % 4 for i in range(8)}
    assert set(reasons.values()) == {FinishReason.LENGTH}
    assert_all_free(scheduler)
