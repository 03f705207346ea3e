"""Async scheduling with steps in flight when the batch changes: preemption (recompute and swap),
parallel-sampling forks, prefix-cache hits on blocks decoded under placeholders, and requests
aborted, stopped or replaced by a request of the same id while their step runs.

The harness (`AsyncCore`, `compare`) is in tests/unit/scheduler_async_core.py.
"""

from __future__ import annotations

import pytest

from engine.outputs import FinishReason, NewSequenceData, SchedulerOutput
from engine.sched.request import Request, RequestStatus
from tests.unit.scheduler_async_core import AsyncCore, Reasons, Tokens, compare, counting, record, run_sync
from tests.unit.scheduler_helpers import collect, indexed_token_fn, make_request, scheduler_and_worker
from tests.unit.scheduler_invariants import assert_all_free, check_invariants, held_blocks

# ---- preemption ---------------------------------------------------------------------------------


def growing_pair() -> list[Request]:
    """Two requests that each take 2 blocks of 4 at once and a third at their 9th token."""
    return [
        make_request("a", range(1, 7), max_tokens=8, arrival_time=0.0),
        make_request("b", range(11, 17), max_tokens=8, arrival_time=1.0),
    ]


def resent(steps: list[SchedulerOutput], seq_id: str) -> list[NewSequenceData]:
    """The full data of a sequence sent again after its first step (a preempted one resuming)."""
    sent = [new for out in steps for new in out.scheduled_new_seqs if new.seq_id == seq_id]
    return sent[1:]


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_with_a_step_in_flight(worker_runs, mode):
    settings = {"num_cpu_blocks": 8, "preemption_mode": "swap"} if mode == "swap" else {}
    (tokens, _, steps, sync_scheduler), core = compare(growing_pair, worker_runs, num_blocks=4, **settings)
    assert tokens == {"a": counting(6, 8), "b": counting(6, 8)}
    assert sync_scheduler.num_preemptions == core.scheduler.num_preemptions == 1
    if mode == "swap":
        assert any(out.blocks_to_swap_out for out in core.steps)
        assert any(out.blocks_to_swap_in for out in core.steps)
    # b was preempted while the step sampling its third token ran: that token still counts (it
    # resumes with it, and does not sample it again), and the steps are the synchronous ones.
    assert core.late_fills == 1
    (resumed,) = resent(core.steps, "b")
    assert resumed.output_token_ids == counting(6, 3)
    assert [out.num_scheduled_tokens for out in core.steps] == [out.num_scheduled_tokens for out in steps]


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_a_sequence_preempted_before_its_last_token_arrives_finishes_in_the_queue(worker_runs, mode):
    """b's third and last token is in flight when a's growth preempts it (b still holds blocks, with
    nothing left to schedule): it finishes where it waits, never resumed, and nothing is left held."""
    settings = {"num_cpu_blocks": 8, "preemption_mode": "swap"} if mode == "swap" else {}
    scheduler, worker = scheduler_and_worker(async_scheduling=True, num_blocks=4, **settings)
    core = AsyncCore(scheduler, worker, worker_runs)
    scheduler.add_request(make_request("a", range(1, 7), max_tokens=8, arrival_time=0.0))
    scheduler.add_request(make_request("b", range(11, 17), max_tokens=3, arrival_time=1.0))
    assert core.run() == (
        {"a": counting(6, 8), "b": counting(6, 3)},
        {"a": FinishReason.LENGTH, "b": FinishReason.LENGTH},
    )
    assert scheduler.num_preemptions == 1 and core.late_fills == 1
    assert resent(core.steps, "b") == []
    assert_all_free(scheduler)


def test_parallel_samples_swapped_out_and_back(worker_runs):
    def requests():
        return [
            make_request("p", range(1, 6), n=2, max_tokens=6, arrival_time=0.0),
            make_request("q", range(11, 16), n=2, max_tokens=6, arrival_time=1.0),
        ]

    (tokens, _, _, _), core = compare(
        requests, worker_runs, indexed_token_fn, num_blocks=7, num_cpu_blocks=16
    )
    assert tokens["p#1"] == counting(5, 6, start=1100) and tokens["q"] == counting(5, 6)
    assert any(out.blocks_to_swap_out for out in core.steps)


def test_a_group_too_big_for_the_cache_keeps_the_tokens_in_flight_when_cut_short(worker_runs):
    """Two samples of a 3-token prompt in 3 blocks of 4: they outgrow the cache at their second
    token. The step sampling it is in flight when the next one finds no room; the request is cut
    short only once that step is back, with its tokens, as without async scheduling."""

    def requests():
        return [make_request("g", range(1, 4), n=2, max_tokens=20)]

    _, core = compare(
        requests, worker_runs, indexed_token_fn, cut_short_may_differ=True, num_blocks=3, num_cpu_blocks=8
    )
    assert core.cut_short == {"g"}  # (compare left it out: checked here)
    assert core.tokens == {"g": [1003, 1004], "g#1": [1103, 1104]}
    assert core.reasons == {"g": FinishReason.LENGTH, "g#1": FinishReason.LENGTH}


# ---- forks and the prefix cache -----------------------------------------------------------------


def test_parallel_sampling_forks(worker_runs):
    def requests():
        return [
            make_request("n3", range(1, 8), n=3, max_tokens=5),
            make_request("best", range(11, 16), n=1, best_of=3, max_tokens=4),
            make_request("plain", range(21, 24), max_tokens=6),
        ]

    (tokens, _, _, _), core = compare(requests, worker_runs, indexed_token_fn, num_blocks=32)
    assert {tokens["n3"][0], tokens["n3#1"][0], tokens["n3#2"][0]} == {1007, 1107, 1207}
    assert len(tokens["best"]) == 4 and tokens["plain"] == counting(3, 6)
    assert core.num_ahead > 0


def test_prefix_cache_hits_on_blocks_decoded_under_placeholders(worker_runs):
    """b's prompt is a's prompt and output: its hits include blocks whose last token a computed as
    a placeholder (the worker checks that every hit holds b's own prefix)."""
    prompt = list(range(1, 11))

    def first():
        return [make_request("a", prompt, max_tokens=9), make_request("a2", [*prompt, 99], max_tokens=3)]

    def second():
        return [make_request("b", prompt + counting(10, 9) + [5, 6], max_tokens=4)]

    results = []
    for async_scheduling in (False, True):
        scheduler, worker = scheduler_and_worker(async_scheduling=async_scheduling, num_blocks=32)
        core = AsyncCore(scheduler, worker, worker_runs) if async_scheduling else None
        outputs: Tokens = {}
        reasons: Reasons = {}
        for phase in (first, second):
            for request in phase():
                scheduler.add_request(request)
            tokens, phase_reasons = core.run() if core else run_sync(scheduler, worker)[:2]
            outputs.update(tokens)
            reasons.update(phase_reasons)
        results.append((outputs, reasons, scheduler.prefix_cache_hits))
        assert_all_free(scheduler)
    assert results[0][:2] == results[1][:2]
    # a2 hit a's prompt blocks, b those of a's prompt and output (4 of 5 full blocks: the last is
    # the one b must compute from), in both runs.
    assert results[1][2] == results[0][2] == 8 + 16


# ---- aborts and stops mid-flight ----------------------------------------------------------------


@pytest.mark.parametrize("in_flight", [1, 2])
@pytest.mark.parametrize("how", ["abort", "stop_string"])
def test_finishing_a_request_mid_flight_frees_every_block(worker_runs, in_flight, how):
    scheduler, worker = scheduler_and_worker(async_scheduling=True, num_blocks=16, max_num_batched_tokens=8)
    core = AsyncCore(scheduler, worker, worker_runs)
    scheduler.add_request(make_request("a", range(1, 7), max_tokens=12))
    scheduler.add_request(make_request("b", range(11, 20), max_tokens=12))
    scheduler.add_request(make_request("c", range(21, 24), max_tokens=12))
    for _ in range(4):
        collect(core.step(), core.tokens, core.reasons)
    if in_flight == 2:
        core.schedule()  # the next step planned, the previous one not yet applied: b in both
        assert len(core.queue) == 2
    assert all("b" in out.num_scheduled_tokens for out, _ in core.queue)
    if how == "abort":
        scheduler.finish_requests(["b"], RequestStatus.FINISHED_ABORTED)
    else:
        scheduler.stop_sequence("b", 0, "stop!")
    check_invariants(scheduler)
    assert "b" not in held_blocks(scheduler)
    core.run()
    assert "b" not in core.reasons  # nothing reported after it finished
    assert core.tokens["a"] == counting(6, 12) and core.tokens["c"] == counting(3, 12)
    assert core.tokens["b"] == counting(9, len(core.tokens["b"]))
    assert_all_free(scheduler)


@pytest.mark.parametrize("how", ["eos", "abort"])
def test_a_new_request_may_reuse_the_id_of_one_whose_step_is_still_in_flight(worker_runs, how):
    """The step planned after x's last token (EOS), or before x was aborted, is still in flight when
    a new request takes the id x: that step's sample belongs to the old x, never to the new one."""
    eos = 7
    scheduler, worker = scheduler_and_worker(
        lambda seq_id, tokens: eos if tokens[0] == 1 and len(tokens) == 6 else 1000 + len(tokens),
        async_scheduling=True,
        num_blocks=16,
    )
    core = AsyncCore(scheduler, worker, worker_runs)
    scheduler.add_request(make_request("x", range(1, 5), max_tokens=10, eos_token_id=eos))
    if how == "eos":
        # As the front end does: step while it waits for a request (not until the queue is empty).
        while scheduler.has_unfinished_requests():
            record(core.step(), core.tokens, core.reasons, core.cut_short)
        assert core.tokens == {"x": [1004, 1005, eos]}
    else:
        for _ in range(2):
            record(core.step(), core.tokens, core.reasons, core.cut_short)
        scheduler.finish_requests(["x"], RequestStatus.FINISHED_ABORTED)
    ((stale, _),) = core.queue
    assert "x" in stale.num_scheduled_tokens  # the old x's step, still in flight
    core.tokens, core.reasons = {}, {}
    scheduler.add_request(make_request("x", range(21, 27), max_tokens=4, eos_token_id=eos))
    assert core.run() == ({"x": counting(6, 4)}, {"x": FinishReason.LENGTH})
    assert_all_free(scheduler)
