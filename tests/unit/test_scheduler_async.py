"""Async scheduling: the scheduler plans step N+1 while step N runs, against the fake worker.

`AsyncCore` drives the scheduler in EngineCore.step's order with async scheduling on (a batch queue
of two): the next step is scheduled before the oldest step's output is applied, so a sequence whose
step samples is scheduled again on a placeholder (`Sequence.num_pending_tokens`), which the worker
fills from its own sample. The fake worker keeps its own samples and writes the scheduler's tokens
over them, as the real one does, and checks every position a sequence attends to (a placeholder
computed on the wrong token, or KV written into the wrong block, fails there).

The "model" is a function of the sequence so far, so every scenario has one right answer: the
synchronous scheduler's, on the same requests. Invariants are checked after every half step, and
every block must be free once the last step in flight returns.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable
from concurrent.futures import Future

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.config import CacheConfig, SchedulerConfig
from engine.outputs import (
    EngineCoreOutput,
    EngineCoreOutputs,
    FinishReason,
    ModelRunnerOutput,
    NewSequenceData,
    SchedulerOutput,
)
from engine.sched.request import Request, RequestStatus, SequenceStatus
from engine.sched.scheduler import Scheduler
from engine.spec_decode.config import SpeculativeConfig
from tests.unit.scheduler_helpers import (
    FakeWorker,
    TokenFn,
    collect,
    default_token_fn,
    indexed_token_fn,
    make_beam_request,
    make_request,
    scheduler_and_worker,
    step,
)
from tests.unit.scheduler_invariants import assert_all_free, check_invariants, held_blocks
from tests.unit.scheduler_scenarios import (
    Scenario,
    build_request,
    group_scenarios,
    pressured_scenarios,
    scenarios,
    token_fn,
)

Tokens = dict[str, list[int]]
Reasons = dict[str, object]


def has_work(out: SchedulerOutput) -> bool:
    """What EngineCore sends to the workers: tokens, block moves or sequences to drop."""
    return bool(out.total_num_scheduled_tokens or out.has_block_moves or out.finished_seq_ids)


class AsyncCore:
    """EngineCore.step with async scheduling, on the fake worker (see the module docstring).

    `worker_runs` is when the worker runs a step: "schedule", as soon as it is scheduled (the
    worker thread ahead of the scheduler), or "update", only when its output is applied (the
    scheduler ahead, planning the next step before this one has even started).
    """

    MAX_IN_FLIGHT = 2

    def __init__(self, scheduler: Scheduler, worker: FakeWorker, worker_runs: str = "schedule") -> None:
        assert scheduler.async_scheduling
        self.scheduler = scheduler
        self.worker = worker
        self.worker_runs = worker_runs
        self.queue: collections.deque[tuple[SchedulerOutput, Callable[[], ModelRunnerOutput]]] = (
            collections.deque()
        )
        self.steps: list[SchedulerOutput] = []  # every step sent to the worker, in order
        self.num_ahead = 0  # steps scheduled while another was in flight
        # Sampled tokens that reached a sequence preempted while their step was in flight.
        self.late_fills = 0
        self.tokens: Tokens = {}
        self.reasons: Reasons = {}
        self.cut_short: set[str] = set()  # requests finished with an error (ignored, or capped)

    # ---- the two halves of a step ---------------------------------------------------------------

    def may_schedule(self) -> bool:
        return (
            len(self.queue) < self.MAX_IN_FLIGHT
            and self.scheduler.has_unfinished_requests()
            and (not self.queue or self.scheduler.may_schedule_ahead())
        )

    def schedule(self) -> list[EngineCoreOutput]:
        """Schedule a step and send it to the worker; the outputs of requests it finished at once."""
        scheduler = self.scheduler
        ahead = bool(self.queue)
        running_before = {request.request_id for request in scheduler.running}
        scheduled = scheduler.schedule()
        out = scheduled.scheduler_output
        self.check_scheduled(out, running_before)
        if has_work(out):
            self.num_ahead += ahead
            self.steps.append(out)
            if self.worker_runs == "schedule":
                result = self.worker.execute(out)
                self.queue.append((out, lambda: result))
            else:
                self.queue.append((out, lambda: self.worker.execute(out)))
        return scheduled.finished_outputs

    def update(self) -> EngineCoreOutputs:
        """Apply the oldest step's output (running it first if the worker has not yet)."""
        scheduler = self.scheduler
        out, result = self.queue.popleft()
        runner_output = result()
        for seq_id in runner_output.seq_ids:
            seq = scheduler.groups.seqs.get(seq_id)
            if seq is not None and seq.status in (SequenceStatus.PREEMPTED, SequenceStatus.SWAPPED):
                self.late_fills += 1
        outputs = scheduler.update_from_output(out, runner_output)
        check_invariants(scheduler)
        for seq in scheduler.groups.seqs.values():
            # Once the oldest step is back, at most the newest one is in flight.
            assert seq.num_pending_tokens <= len(self.queue), seq
        return outputs

    def step(self, mid_step: Callable[[], None] | None = None) -> EngineCoreOutputs:
        """One EngineCore.step: schedule if the queue has room (and may run ahead), then return the
        oldest step's outputs, unless the queue was only being filled. `mid_step` runs between the
        two (as an abort arriving then would)."""
        finished: list[EngineCoreOutput] = []
        if self.may_schedule():
            num_before = len(self.queue)
            finished = self.schedule()
            sent = len(self.queue) > num_before
            if sent and len(self.queue) < self.MAX_IN_FLIGHT and self.scheduler.may_schedule_ahead():
                return EngineCoreOutputs(outputs=finished)
        if mid_step is not None:
            mid_step()
        if not self.queue:
            return EngineCoreOutputs(outputs=finished)
        outputs = self.update()
        outputs.outputs = finished + outputs.outputs
        return outputs

    def run(self, max_steps: int = 500) -> tuple[Tokens, Reasons]:
        """Step until no request is left and the last step in flight has returned."""
        for _ in range(max_steps):
            if not self.scheduler.has_unfinished_requests() and not self.queue:
                return self.tokens, self.reasons
            record(self.step(), self.tokens, self.reasons, self.cut_short)
        raise AssertionError(f"not done after {max_steps} steps: {self.scheduler.running}")

    # ---- checks ---------------------------------------------------------------------------------

    def check_scheduled(self, out: SchedulerOutput, running_before: set[str]) -> None:
        scheduler = self.scheduler
        check_invariants(scheduler)
        assert out.total_num_scheduled_tokens <= scheduler.max_num_batched_tokens
        assert len(out.num_scheduled_tokens) <= scheduler.max_num_seqs
        for seq_id in out.num_scheduled_tokens:
            seq = scheduler.groups.seqs[seq_id]
            request = seq.request
            # The last token a sequence may have is sampled, never computed: no step goes past it.
            length = scheduler.max_seq_len
            max_tokens = request.sampling_params.max_tokens
            if max_tokens is not None:
                length = min(length, request.num_prompt_tokens + max_tokens)
            most = max(length - 1, request.num_prompt_tokens)
            assert seq.num_computed_tokens <= most, f"{seq} computed past its last token ({length} in all)"
            if request.runs_on_placeholders:
                assert seq.num_pending_tokens <= len(self.queue) + 1, seq
            else:  # beam search, grammars: only known tokens
                assert seq.num_pending_tokens == 0 and seq.num_computed_tokens <= seq.num_tokens, seq
                # Once running, such a request's steps are planned with nothing else in flight (it
                # may be admitted into a step planned ahead: its first inputs are all known).
                assert request.request_id not in running_before or not self.queue, seq


# ---- running a scenario both ways ---------------------------------------------------------------


def record(outputs: EngineCoreOutputs, tokens: Tokens, reasons: Reasons, cut_short: set[str]) -> None:
    """`collect`, and the requests that finished with an error."""
    collect(outputs, tokens, reasons)
    cut_short.update(output.request_id for output in outputs.outputs if output.error)


def run_sync(
    scheduler: Scheduler, worker: FakeWorker, cut_short: set[str] | None = None
) -> tuple[Tokens, Reasons, list[SchedulerOutput]]:
    """The synchronous reference: schedule, run, update, one step at a time."""
    tokens: Tokens = {}
    reasons: Reasons = {}
    steps = []
    for _ in range(500):
        if not scheduler.has_unfinished_requests():
            return tokens, reasons, steps
        out, outputs = step(scheduler, worker)
        if has_work(out):
            steps.append(out)
        record(outputs, tokens, reasons, set() if cut_short is None else cut_short)
    raise AssertionError("the synchronous run does not end")


def computed_per_seq(steps: Iterable[SchedulerOutput]) -> collections.Counter[str]:
    """Tokens computed per sequence over a run (recomputation after preemption included)."""
    total: collections.Counter[str] = collections.Counter()
    for out in steps:
        total.update(out.num_scheduled_tokens)
    return total


@pytest.fixture(params=["schedule", "update"])
def worker_runs(request) -> str:
    return request.param


def compare(
    requests: Callable[[], list[Request]],
    worker_runs: str,
    token_fn: TokenFn = default_token_fn,
    cut_short_may_differ: bool = False,
    **settings,
) -> tuple[tuple[Tokens, Reasons, list[SchedulerOutput], Scheduler], AsyncCore]:
    """Run the requests (built afresh for each run) synchronously and with async scheduling; the
    outputs and finish reasons must be the same, and both runs must end with every block free.

    With `cut_short_may_differ`, requests finished with an error in either run are left out: in a
    cache too small for a request, where it is cut short depends on what ran beside it when."""
    sync_scheduler, sync_worker = scheduler_and_worker(token_fn, **settings)
    for request in requests():
        sync_scheduler.add_request(request)
    cut_short: set[str] = set()
    tokens, reasons, steps = run_sync(sync_scheduler, sync_worker, cut_short)
    assert_all_free(sync_scheduler)

    scheduler, worker = scheduler_and_worker(token_fn, async_scheduling=True, **settings)
    core = AsyncCore(scheduler, worker, worker_runs)
    for request in requests():
        scheduler.add_request(request)
    results = core.run()
    if cut_short_may_differ:
        cut_short |= core.cut_short
        results = tuple(_without(result, cut_short) for result in results)
        tokens, reasons = _without(tokens, cut_short), _without(reasons, cut_short)
    else:
        assert not cut_short and not core.cut_short
    assert results == (tokens, reasons)
    assert_all_free(scheduler)
    assert scheduler.make_stats().kv_cache_usage == 0.0
    return (tokens, reasons, steps, sync_scheduler), core


def _without(by_key: dict, request_ids: set[str]) -> dict:
    return {key: value for key, value in by_key.items() if key.partition("#")[0] not in request_ids}


def counting(prompt_len: int, num: int, start: int = 1000) -> list[int]:
    """What `default_token_fn` samples after a prompt of `prompt_len` tokens."""
    return [start + prompt_len + i for i in range(num)]


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
    assert _without(core.tokens, left_out) == _without(expected, left_out)
    assert _without(core.reasons, left_out) == _without(expected_reasons, left_out)
