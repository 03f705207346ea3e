"""Requests as groups of sequences: parallel sampling (n, best_of), swap preemption, stopping one
sequence, and beam search, against schedules worked out by hand (block size 4 unless said).

The fake worker samples `indexed_token_fn`: 1000 + 100 * index + length, so an output token tells
which sequence sampled it and at which length.
"""

from __future__ import annotations

import logging

import pytest

from engine.outputs import FinishReason
from engine.sched.request import RequestStatus, SequenceStatus
from tests.unit.reference_beam_search import reference_sequence
from tests.unit.scheduler_helpers import (
    block_ref_counts,
    collect,
    indexed_scheduler_and_worker,
    indexed_token_fn,
    make_request,
    outputs_by_key,
    run_until_done,
    step,
)
from tests.unit.scheduler_invariants import (
    assert_all_free,
    check_invariants,
    held_blocks,
    swapped_blocks,
)

setup = indexed_scheduler_and_worker
by_key = outputs_by_key
refs = block_ref_counts


# ---- parallel sampling ----------------------------------------------------------------------------


def test_n_sequences_prefill_the_prompt_once_then_fork_and_copy_the_partial_block():
    scheduler, worker = setup(num_blocks=16)
    request = make_request("r", range(10), n=3, seed=7, max_tokens=3)
    scheduler.add_request(request)
    kv = scheduler.kv_cache_manager

    # The first sequence computes the prompt but its last token: 9 tokens, blocks 0, 1 and 2 (one token).
    out, outputs = step(scheduler, worker)
    assert out.num_scheduled_tokens == {"r": 9}
    (new,) = out.scheduled_new_seqs
    assert (new.seq_id, new.block_ids, new.num_computed_tokens, new.seed) == ("r", [0, 1, 2], 0, 7)
    assert outputs.outputs == [] and len(request.seqs) == 1
    assert kv.num_free_blocks == 13

    # Then it forks twice; every sequence computes the last prompt token itself, into block 2: the
    # first two writers copy it (2 -> 3, 2 -> 4), the last one writes it in place.
    out, outputs = step(scheduler, worker)
    assert [seq.seq_id for seq in request.seqs] == ["r", "r#1", "r#2"]
    assert out.num_scheduled_tokens == {"r": 1, "r#1": 1, "r#2": 1}
    assert out.blocks_to_copy == [(2, 3), (2, 4)]
    cached = out.scheduled_cached_seqs
    assert (cached.seq_ids, cached.block_table_starts, cached.new_block_ids) == (["r"], [2], [[3]])
    assert [(n.seq_id, n.block_ids, n.num_computed_tokens, n.seed) for n in out.scheduled_new_seqs] == [
        ("r#1", [0, 1, 4], 9, 8),
        ("r#2", [0, 1, 2], 9, 9),
    ]
    assert held_blocks(scheduler) == {"r": [0, 1, 3], "r#1": [0, 1, 4], "r#2": [0, 1, 2]}
    # The prompt's full blocks exist once, shared by all three; one partial block each.
    assert refs(scheduler)[:5] == [3, 3, 1, 1, 1] and kv.num_free_blocks == 11
    assert {key: o.new_token_ids for key, o in by_key(outputs).items()} == {
        ("r", 0): [1010],
        ("r", 1): [1110],
        ("r", 2): [1210],
    }

    # Decoding: each sequence in its own block, no more copies.
    out, _ = step(scheduler, worker)
    assert out.blocks_to_copy == [] and out.scheduled_new_seqs == []
    assert out.scheduled_cached_seqs.block_table_starts == [3, 3, 3]
    _tokens, _reasons = run_until_done(scheduler, worker)
    assert request.is_finished
    assert [seq.output_token_ids for seq in request.seqs] == [
        [1010, 1011, 1012],
        [1110, 1111, 1112],
        [1210, 1211, 1212],
    ]
    assert [seq.status for seq in request.seqs] == [SequenceStatus.FINISHED_LENGTH_CAPPED] * 3
    assert_all_free(scheduler)


def test_prompt_whose_length_minus_one_fills_whole_blocks_needs_no_copy():
    scheduler, worker = setup(num_blocks=16)
    scheduler.add_request(make_request("r", range(9), n=2, max_tokens=2))
    out, _ = step(scheduler, worker)
    assert out.num_scheduled_tokens == {"r": 8} and out.scheduled_new_seqs[0].block_ids == [0, 1]
    out, outputs = step(scheduler, worker)
    # Position 8 opens a new block for each sequence: nothing shared is written.
    assert out.blocks_to_copy == []
    assert held_blocks(scheduler) == {"r": [0, 1, 2], "r#1": [0, 1, 3]}
    assert sorted(o.index for o in outputs.outputs) == [0, 1]
    _tokens, reasons = run_until_done(scheduler, worker)
    assert reasons == {"r": FinishReason.LENGTH, "r#1": FinishReason.LENGTH}
    assert_all_free(scheduler)


def test_one_token_prompt_forks_at_once():
    scheduler, worker = setup(num_blocks=8)
    scheduler.add_request(make_request("r", [5], n=2, max_tokens=2))
    out, outputs = step(scheduler, worker)
    # Nothing to prefill before the fork: both sequences compute the one prompt token.
    assert out.num_scheduled_tokens == {"r": 1, "r#1": 1} and out.blocks_to_copy == []
    assert held_blocks(scheduler) == {"r": [0], "r#1": [1]}
    assert {(o.index, tuple(o.new_token_ids)) for o in outputs.outputs} == {(0, (1001,)), (1, (1101,))}
    tokens, _ = run_until_done(scheduler, worker)
    assert tokens == {"r": [1002], "r#1": [1102]}
    assert_all_free(scheduler)


def test_forks_fit_when_only_the_last_writer_keeps_the_shared_block():
    # 3 blocks: the prompt's 5 tokens take 2; 2 sequences writing block 1 need 1 copy, not 2.
    scheduler, worker = setup(num_blocks=3)
    request = make_request("r", range(6), n=2, max_tokens=2)
    scheduler.add_request(request)
    step(scheduler, worker)
    out, _ = step(scheduler, worker)
    assert out.num_scheduled_tokens == {"r": 1, "r#1": 1} and out.blocks_to_copy == [(1, 2)]
    assert scheduler.num_preemptions == 0
    _, reasons = run_until_done(scheduler, worker)
    assert request.error is None and scheduler.num_preemptions == 0
    assert [seq.output_token_ids for seq in request.seqs] == [[1006, 1007], [1106, 1107]]
    assert reasons == {"r": FinishReason.LENGTH, "r#1": FinishReason.LENGTH}
    assert_all_free(scheduler)


def test_forking_request_whose_prompt_is_cached_up_to_its_last_token():
    scheduler, worker = setup(num_blocks=16)
    scheduler.add_request(make_request("first", [*range(8), 50], max_tokens=1))
    run_until_done(scheduler, worker)  # blocks 0 and 1 (tokens 0..7) stay cached
    request = make_request("r", [*range(8), 60], n=2, max_tokens=2)
    scheduler.add_request(request)
    out, _ = step(scheduler, worker)
    # The cached blocks hold all 8 tokens before the fork; one is recomputed so the request runs.
    assert out.num_scheduled_tokens == {"r": 4}
    assert out.scheduled_new_seqs[0].num_computed_tokens == 4
    tokens, _reasons = run_until_done(scheduler, worker)
    assert tokens == {"r": [1009, 1010], "r#1": [1109, 1110]}
    assert request.num_cached_tokens == 4
    assert_all_free(scheduler)


def test_best_of_runs_every_sequence_with_its_cumulative_logprob():
    scheduler, worker = setup(num_blocks=16)
    request = make_request("r", range(5), n=1, best_of=3, max_tokens=3)
    scheduler.add_request(request)
    out, _ = step(scheduler, worker)
    # best_of ranks by cumulative log-probability: the workers return the sampled token's.
    assert out.scheduled_new_seqs[0].num_logprobs == 0
    tokens: dict = {}
    reasons: dict = {}
    finals = {}
    while scheduler.has_unfinished_requests():
        _, outputs = step(scheduler, worker)
        collect(outputs, tokens, reasons)
        for output in outputs.outputs:
            assert output.new_logprobs is not None and len(output.new_logprobs.token_ids[0]) == 1
            if output.finished:
                finals[output.index] = output.cumulative_logprob
    assert sorted(finals) == [0, 1, 2]
    for index in range(3):
        seq_id = f"r#{index}" if index else "r"
        expected, reason, cumulative = reference_sequence(
            seq_id, list(range(5)), indexed_token_fn, max_tokens=3, eos_token_id=None, max_seq_len=1024
        )
        assert (tokens[seq_id], reasons[seq_id]) == (expected, reason)
        assert finals[index] == pytest.approx(cumulative)
        assert request.seqs[index].cumulative_logprob == pytest.approx(cumulative)
    assert_all_free(scheduler)


def test_more_sequences_than_max_num_seqs_is_ignored_not_stuck():
    scheduler, worker = setup(num_blocks=16, max_num_seqs=2)
    scheduler.add_request(make_request("wide", range(4), n=3, arrival_time=0))
    scheduler.add_request(make_request("ok", range(4), max_tokens=1, arrival_time=1))
    tokens, reasons = run_until_done(scheduler, worker)
    assert reasons == {"wide": FinishReason.LENGTH, "ok": FinishReason.LENGTH}
    assert tokens["wide"] == [] and tokens["ok"] == [1004]
    assert_all_free(scheduler)


def test_group_larger_than_the_whole_cache_is_cut_short_not_stuck():
    scheduler, worker = setup(num_blocks=1)
    wide = make_request("wide", [5], n=2, arrival_time=0)  # two sequences, one block each
    scheduler.add_request(wide)
    scheduler.add_request(make_request("ok", [6], max_tokens=1, arrival_time=1))
    out, outputs = step(scheduler, worker)
    assert out.num_scheduled_tokens == {"ok": 1}  # the queue moves on
    report = by_key(outputs)
    assert [report[("wide", i)].finish_reason for i in (0, 1)] == [FinishReason.LENGTH] * 2
    assert "do not fit" in report[("wide", 0)].error and report[("wide", 0)].new_token_ids == []
    assert wide.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert_all_free(scheduler)


# ---- stopping one sequence ------------------------------------------------------------------------


def test_stop_sequence_finishes_one_sequence_and_frees_its_blocks():
    scheduler, worker = setup(num_blocks=16)
    request = make_request("r", range(6), n=2, max_tokens=10)
    scheduler.add_request(request)
    step(scheduler, worker)
    step(scheduler, worker)  # forked: r [0, 2], r#1 [0, 1]
    assert held_blocks(scheduler) == {"r": [0, 2], "r#1": [0, 1]}
    scheduler.stop_sequence("r", 1, "a stop string")
    child = request.seqs[1]
    assert child.status == SequenceStatus.FINISHED_STOPPED and child.stop_reason == "a stop string"
    assert held_blocks(scheduler) == {"r": [0, 2]} and refs(scheduler)[:3] == [1, 0, 1]
    assert not request.is_finished and "r#1" not in scheduler.groups.seqs
    scheduler.stop_sequence("r", 1, "again")  # no longer live: ignored
    scheduler.stop_sequence("nope", 0, "unknown")
    assert child.stop_reason == "a stop string"
    check_invariants(scheduler)
    out, outputs = step(scheduler, worker)
    assert out.finished_seq_ids == ["r#1"] and out.num_scheduled_tokens == {"r": 1}
    assert [o.index for o in outputs.outputs] == [0]
    scheduler.stop_sequence("r", 0, "the other")
    assert request.is_finished and "r" not in scheduler.requests
    assert request.seqs[0].status == SequenceStatus.FINISHED_STOPPED
    assert_all_free(scheduler)
    assert scheduler.schedule().scheduler_output.finished_seq_ids == ["r"]


def test_stop_sequence_between_schedule_and_update_drops_its_token():
    scheduler, worker = setup(num_blocks=16)
    request = make_request("r", range(6), n=2, max_tokens=10)
    scheduler.add_request(request)
    step(scheduler, worker)
    out = scheduler.schedule().scheduler_output
    runner_output = worker.execute(out)
    assert sorted(runner_output.seq_ids) == ["r", "r#1"]
    scheduler.stop_sequence("r", 0, "stop")
    outputs = scheduler.update_from_output(out, runner_output)
    assert [o.index for o in outputs.outputs] == [1]
    assert request.seqs[0].output_token_ids == [] and request.seqs[1].output_token_ids == [1106]
    check_invariants(scheduler)
    run_until_done(scheduler, worker)
    assert_all_free(scheduler)


# ---- swap preemption ------------------------------------------------------------------------------


def two_forked_groups(**kwargs):
    """a and b (later), each n=2 with a 6-token prompt; 7 device blocks: each group takes 3 blocks at
    its fork, and both need 2 more (one per sequence) at their 9th token."""
    scheduler, worker = setup(num_blocks=7, **kwargs)
    a = make_request("a", range(6), n=2, max_tokens=6, arrival_time=0)
    b = make_request("b", range(100, 106), n=2, max_tokens=6, arrival_time=1)
    scheduler.add_request(a)
    scheduler.add_request(b)
    out, _ = step(scheduler, worker)  # a: [0, 1], b: [2, 3] (5 prompt tokens each)
    assert out.num_scheduled_tokens == {"a": 5, "b": 5}
    out, _ = step(scheduler, worker)  # forks: a copies 1 -> 4, b copies 3 -> 5
    assert out.blocks_to_copy == [(1, 4), (3, 5)]
    assert held_blocks(scheduler) == {"a": [0, 4], "a#1": [0, 1], "b": [2, 5], "b#1": [2, 3]}
    step(scheduler, worker)
    step(scheduler, worker)  # every sequence at 9 tokens, 8 computed; block 6 free
    assert scheduler.kv_cache_manager.num_free_blocks == 1
    return scheduler, worker, a, b


def unconstrained_tokens(requests) -> dict[str, list[int]]:
    scheduler, worker = setup(num_blocks=64)
    for request in requests:
        scheduler.add_request(make_request(request.request_id, request.prompt_token_ids, n=2, max_tokens=6))
    tokens, _ = run_until_done(scheduler, worker)
    return tokens


def test_group_is_swapped_out_and_back_with_its_sharing():
    scheduler, worker, a, b = two_forked_groups(num_cpu_blocks=8)
    tokens: dict = {}
    reasons: dict = {}
    for request in (a, b):
        for seq in request.seqs:
            tokens[seq.seq_id] = list(seq.output_token_ids)

    # a needs two blocks, one is free: b (later) goes to the CPU, its shared block 2 once.
    out, outputs = step(scheduler, worker)
    collect(outputs, tokens, reasons)
    assert out.blocks_to_swap_out == [(2, 0), (5, 1), (3, 2)]
    assert out.finished_seq_ids == ["b", "b#1"]  # the workers drop their state
    assert out.num_scheduled_tokens == {"a": 1, "a#1": 1}
    assert held_blocks(scheduler) == {"a": [0, 4, 6], "a#1": [0, 1, 5]}
    assert swapped_blocks(scheduler) == {"b": [0, 1], "b#1": [0, 2]}
    assert b.status == RequestStatus.SWAPPED and scheduler.swapped == [b]
    assert [seq.num_computed_tokens for seq in b.seqs] == [8, 8]  # kept, on the CPU
    assert (scheduler.num_preemptions, b.num_preemptions) == (1, 1)
    assert outputs.scheduler_stats.num_waiting_reqs == 1

    # Two device blocks free, three needed: b stays out while a runs; nothing new is admitted.
    late = make_request("late", [7, 7], max_tokens=1, arrival_time=2)
    scheduler.add_request(late)
    for _ in range(2):
        out, outputs = step(scheduler, worker)
        collect(outputs, tokens, reasons)
        assert out.blocks_to_swap_in == [] and set(out.num_scheduled_tokens) == {"a", "a#1"}
    assert a.is_finished

    # a is done: b comes back first, into fresh blocks, before late is admitted.
    out, outputs = step(scheduler, worker)
    collect(outputs, tokens, reasons)
    assert out.blocks_to_swap_in == [(0, 3), (1, 2), (2, 6)]
    assert out.blocks_to_swap_out == [] and out.blocks_to_copy == []
    assert [(n.seq_id, n.block_ids, n.num_computed_tokens) for n in out.scheduled_new_seqs] == [
        ("b", [3, 2, 4], 8),
        ("b#1", [3, 6, 5], 8),
        ("late", [1], 0),
    ]
    assert out.num_scheduled_tokens == {"b": 1, "b#1": 1, "late": 2}
    assert swapped_blocks(scheduler) == {} and scheduler.kv_cache_manager.cpu_pool.num_free_blocks == 8

    tokens_rest, reasons_rest = run_until_done(scheduler, worker)
    for key, value in tokens_rest.items():
        tokens.setdefault(key, []).extend(value)
    reasons.update(reasons_rest)
    expected = unconstrained_tokens([a, b])
    assert {k: v for k, v in tokens.items() if k != "late"} == expected
    assert set(reasons.values()) == {FinishReason.LENGTH}
    assert_all_free(scheduler)


def test_aborting_a_swapped_request_frees_its_cpu_blocks():
    scheduler, worker, _a, b = two_forked_groups(num_cpu_blocks=8)
    step(scheduler, worker)
    assert b.status == RequestStatus.SWAPPED
    scheduler.finish_requests(["b"], RequestStatus.FINISHED_ABORTED)
    assert b.status == RequestStatus.FINISHED_ABORTED and scheduler.swapped == []
    assert all(seq.status == SequenceStatus.FINISHED_ABORTED for seq in b.seqs)
    assert scheduler.kv_cache_manager.cpu_pool.num_free_blocks == 8 and swapped_blocks(scheduler) == {}
    check_invariants(scheduler)
    out, _ = step(scheduler, worker)
    assert out.finished_seq_ids == []  # the workers dropped b when it was swapped out
    _, reasons = run_until_done(scheduler, worker)
    assert set(reasons) == {"a", "a#1"}
    assert_all_free(scheduler)


@pytest.mark.parametrize(
    ("kwargs", "warns"),
    [({"num_cpu_blocks": 8, "preemption_mode": "recompute"}, False), ({"num_cpu_blocks": 2}, True)],
    ids=["recompute-mode", "cpu-pool-too-small"],
)
def test_group_preempted_by_recompute(kwargs, warns, caplog):
    scheduler, worker, a, b = two_forked_groups(**kwargs)
    tokens = {seq.seq_id: list(seq.output_token_ids) for request in (a, b) for seq in request.seqs}
    reasons: dict = {}
    with caplog.at_level(logging.WARNING, logger="engine.sched.scheduler"):
        out, outputs = step(scheduler, worker)
    collect(outputs, tokens, reasons)
    assert ("preempted by recompute" in caplog.text) == warns
    # b's three blocks (shared one included) are freed, not moved; b waits to be recomputed.
    assert out.blocks_to_swap_out == [] and out.finished_seq_ids == ["b", "b#1"]
    assert b.status == RequestStatus.PREEMPTED and scheduler.waiting == [b]
    assert [seq.num_computed_tokens for seq in b.seqs] == [0, 0]
    assert held_blocks(scheduler) == {"a": [0, 4, 6], "a#1": [0, 1, 5]}
    assert swapped_blocks(scheduler) == {}
    readmitted = []
    while scheduler.has_unfinished_requests():
        out, outputs = step(scheduler, worker)
        collect(outputs, tokens, reasons)
        readmitted += out.scheduled_new_seqs
        assert out.blocks_to_swap_in == []
    # Both sequences come back with their outputs, from their cached blocks: b's second block was
    # reused by a, b#1's (block 3) was not.
    assert [(n.seq_id, n.output_token_ids, n.num_computed_tokens) for n in readmitted] == [
        ("b", b.seqs[0].output_token_ids[:3], 4),
        ("b#1", b.seqs[1].output_token_ids[:3], 8),
    ]
    assert tokens == unconstrained_tokens([a, b])
    assert_all_free(scheduler)


def test_swap_mode_swaps_a_single_sequence_too():
    scheduler, worker = setup(num_blocks=4, num_cpu_blocks=4, preemption_mode="swap")
    a = make_request("a", range(1, 7), max_tokens=8, arrival_time=0)
    b = make_request("b", range(11, 17), max_tokens=8, arrival_time=1)
    scheduler.add_request(a)
    scheduler.add_request(b)
    for _ in range(3):
        step(scheduler, worker)
    out, _ = step(scheduler, worker)  # a needs a third block: b is swapped out whole
    assert out.blocks_to_swap_out == [(2, 0), (3, 1)] and b.status == RequestStatus.SWAPPED
    _tokens, _ = run_until_done(scheduler, worker)
    assert b.seqs[0].output_token_ids == a.seqs[0].output_token_ids == list(range(1006, 1014))
    assert_all_free(scheduler)
