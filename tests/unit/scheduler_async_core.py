"""Async scheduling against the fake worker: the core that drives it, and the synchronous reference.

`AsyncCore` drives the scheduler in EngineCore.step's order with async scheduling on (a batch queue
of two): the next step is scheduled before the oldest step's output is applied, so a sequence whose
step samples is scheduled again on a placeholder (`Sequence.num_pending_tokens`), which the worker
fills from its own sample. The fake worker keeps its own samples and writes the scheduler's tokens
over them, as the real one does, and checks every position a sequence attends to (a placeholder
computed on the wrong token, or KV written into the wrong block, fails there).

The "model" is a function of the sequence so far, so every scenario has one right answer: the
synchronous scheduler's, on the same requests (`compare`). Invariants are checked after every half
step, and every block must be free once the last step in flight returns.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable

from engine.outputs import EngineCoreOutput, EngineCoreOutputs, ModelRunnerOutput, SchedulerOutput
from engine.sched.request import Request, SequenceStatus
from engine.sched.scheduler import Scheduler
from tests.unit.scheduler_helpers import (
    FakeWorker,
    TokenFn,
    collect,
    default_token_fn,
    scheduler_and_worker,
    step,
)
from tests.unit.scheduler_invariants import assert_all_free, check_invariants

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
        results = tuple(without_requests(result, cut_short) for result in results)
        tokens, reasons = without_requests(tokens, cut_short), without_requests(reasons, cut_short)
    else:
        assert not cut_short and not core.cut_short
    assert results == (tokens, reasons)
    assert_all_free(scheduler)
    assert scheduler.make_stats().kv_cache_usage == 0.0
    return (tokens, reasons, steps, sync_scheduler), core


def without_requests(by_key: dict, request_ids: set[str]) -> dict:
    """`by_key` (by request id or seq id) without the entries of `request_ids`."""
    return {key: value for key, value in by_key.items() if key.partition("#")[0] not in request_ids}


def counting(prompt_len: int, num: int, start: int = 1000) -> list[int]:
    """What `default_token_fn` samples after a prompt of `prompt_len` tokens."""
    return [start + prompt_len + i for i in range(num)]
