"""Scheduler, step by step, against schedules worked out by hand (block size 4 throughout).

The fake worker samples `1000 + len(tokens)` unless a test scripts its tokens, so an output token
tells at which sequence length it was sampled.
"""

from __future__ import annotations

import pytest

from engine.outputs import FinishReason, ModelRunnerOutput
from engine.sched.request import RequestStatus, SequenceStatus
from tests.unit.scheduler_helpers import (
    make_request,
    outputs_by_id,
    run_until_done,
    scheduler_and_worker,
    step,
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
