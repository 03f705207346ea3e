"""Randomized runs of the scheduler against a fake worker, with invariants checked every step.

Each example draws a cache (block size, a few blocks, sometimes a small CPU swap pool and a
preemption mode), limits (token budget, sequence cap, model length), and requests with shared
prefixes, priorities, arrival steps, aborts and stopped sequences: plain requests, parallel
sampling (n, best_of) and beam search. The "model" is a function of the sequence so far (and of a
sequence's index, as its seed would be), so every sequence that is not aborted or stopped has one
right answer, computed here by a plain loop or a plain beam search (the oracles): preemption by
recompute or swap, chunking, forks and prefix caching must never change it.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from hypothesis import HealthCheck, given, settings

from engine.outputs import EngineCoreOutput, FinishReason, SchedulerOutput
from engine.sched.request import Request, RequestStatus, SequenceStatus
from engine.sched.scheduler import Scheduler
from tests.unit.reference_beam_search import reference_beam_search, reference_sequence
from tests.unit.scheduler_helpers import (
    FakeWorker,
    make_scheduler,
    output_key,
)
from tests.unit.scheduler_invariants import (
    assert_all_free,
    check_invariants,
    held_blocks,
    swapped_blocks,
)
from tests.unit.scheduler_scenarios import (
    Scenario,
    Spec,
    build_request,
    group_scenarios,
    pressured_scenarios,
    scenarios,
    token_fn,
)


@dataclass
class Snapshot:
    """The scheduler's queues and block tables before a step."""

    running: set[str]
    waiting: set[str]
    swapped: set[str]
    device: dict[str, list[int]]
    cpu: dict[str, list[int]]
    seqs: set[str]

    @classmethod
    def of(cls, scheduler: Scheduler) -> Snapshot:
        return cls(
            running={r.request_id for r in scheduler.running},
            waiting={r.request_id for r in scheduler.waiting},
            swapped={r.request_id for r in scheduler.swapped},
            device=held_blocks(scheduler),
            cpu=swapped_blocks(scheduler),
            seqs=set(scheduler.groups.seqs),
        )


@dataclass
class QueueMoves:
    """How one schedule() call moved requests between the queues."""

    victims: list[Request]  # running before, preempted (or swapped out) now
    survivors: list[Request]  # running before and still running
    admitted: list[Request]  # waiting before, running now
    resumed: list[Request]  # swapped before, running now
    capped_running: bool  # a request running before was cut short with an error

    @classmethod
    def of(cls, requests: dict[str, Request], scheduler: Scheduler, before: Snapshot) -> QueueMoves:
        return cls(
            victims=[
                requests[r]
                for r in before.running
                if requests[r].status in (RequestStatus.PREEMPTED, RequestStatus.SWAPPED)
            ],
            survivors=[r for r in scheduler.running if r.request_id in before.running],
            admitted=[requests[r] for r in before.waiting if requests[r] in scheduler.running],
            resumed=[requests[r] for r in before.swapped if requests[r] in scheduler.running],
            capped_running=any(requests[r].is_finished and requests[r].error for r in before.running),
        )


class Run:
    """One scenario's run: the scheduler, the worker, and what came out."""

    def __init__(self, sc: Scenario) -> None:
        self.sc = sc
        self.scheduler = make_scheduler(
            num_blocks=sc.num_blocks,
            block_size=sc.block_size,
            max_num_seqs=sc.max_num_seqs,
            max_num_batched_tokens=sc.max_num_batched_tokens,
            max_model_len=sc.max_model_len,
            enable_prefix_caching=sc.enable_prefix_caching,
            num_cpu_blocks=sc.num_cpu_blocks,
            preemption_mode=sc.preemption_mode,
        )
        self.worker = FakeWorker(sc.block_size, token_fn, self.scheduler)
        self.max_seq_len = min(sc.max_model_len, sc.num_blocks * sc.block_size)
        self.requests: dict[str, Request] = {}
        self.aborted: set[str] = set()  # aborted while still alive
        self.stopped: set[str] = set()  # sequence keys stopped by stop_sequence while alive
        self.outputs: dict[str, list] = {}  # per output key (request id, or id#index)
        self.capped: set[str] = set()  # requests cut short with an error (not ignored)

    # ---- events from outside ---------------------------------------------------------------------

    def add_arrivals(self, step_index: int) -> None:
        for i, spec in enumerate(self.sc.specs):
            if spec.arrival_step == step_index:
                request = build_request(spec, f"r{i}", step_index + i / 100)
                self.requests[request.request_id] = request
                self.scheduler.add_request(request)

    def abort(self, step_index: int, mid_step: bool) -> None:
        for i, spec in enumerate(self.sc.specs):
            req_id = f"r{i}"
            if spec.abort_step == step_index and spec.abort_mid_step == mid_step and req_id in self.requests:
                if not self.requests[req_id].is_finished:
                    self.aborted.add(req_id)
                self.scheduler.finish_requests([req_id], RequestStatus.FINISHED_ABORTED)
                assert self.requests[req_id].is_finished
                assert req_id not in self.scheduler.requests

    def stop(self, step_index: int, mid_step: bool) -> None:
        for i, spec in enumerate(self.sc.specs):
            req_id = f"r{i}"
            if spec.stop is None or (spec.stop[0], spec.stop[2]) != (step_index, mid_step):
                continue
            request = self.requests.get(req_id)
            index = spec.stop[1]
            if request is None:
                continue
            live = [seq for seq in request.live_seqs if seq.index == index]
            was_live = bool(live) and not request.is_finished
            self.scheduler.stop_sequence(req_id, index, "stop!")
            if was_live:
                (seq,) = live
                self.stopped.add(seq.seq_id)
                assert seq.status == SequenceStatus.FINISHED_STOPPED and seq.stop_reason == "stop!"
                assert seq.seq_id not in self.scheduler.groups.seqs
                assert not held_blocks(self.scheduler).get(seq.seq_id)
                assert not swapped_blocks(self.scheduler).get(seq.seq_id)
                assert request.is_finished == (not request.live_seqs)

    # ---- one step --------------------------------------------------------------------------------

    def step(self, step_index: int) -> None:
        """Schedule, check every rule of the step's decisions, run the worker, update, check again."""
        scheduler = self.scheduler
        before = Snapshot.of(scheduler)
        scheduled = scheduler.schedule()
        out = scheduled.scheduler_output
        check_invariants(scheduler)
        moves = QueueMoves.of(self.requests, scheduler, before)
        self.check_step_limits(out)
        self.check_no_work_waits_behind_an_idle_engine(out, moves)
        self.check_preemption_takes_the_lowest_priority(out, moves)
        self.check_swap_out(out, moves.victims, before.device, before.seqs)
        self.check_nothing_admitted_while_preempting_or_swapped(out, moves)
        self.check_admission_is_fcfs(moves)
        self.check_swap_in(out, moves.resumed, before.cpu)
        self.check_prefix_hits_are_whole_blocks(out, moves.admitted)

        runner_output = self.worker.execute(out)
        self.abort(step_index, mid_step=True)
        self.stop(step_index, mid_step=True)
        outputs = scheduler.update_from_output(out, runner_output)
        check_invariants(scheduler)
        self.record_outputs(scheduled.finished_outputs + outputs.outputs)

    def check_step_limits(self, out: SchedulerOutput) -> None:
        """The step stays within the token budget and max_num_seqs, and schedules no empty sequence."""
        assert out.total_num_scheduled_tokens <= self.sc.max_num_batched_tokens, "token budget exceeded"
        assert len(out.num_scheduled_tokens) <= self.sc.max_num_seqs, "more sequences than max_num_seqs"
        assert all(n >= 1 for n in out.num_scheduled_tokens.values()), "a sequence scheduled for no token"

    def check_no_work_waits_behind_an_idle_engine(self, out: SchedulerOutput, moves: QueueMoves) -> None:
        """Waiting work never sits behind an idle engine (unless this step cut short the only running
        request, after it had evicted the others), and running requests always get tokens."""
        scheduler = self.scheduler
        if (scheduler.waiting or scheduler.swapped) and not (moves.victims and moves.capped_running):
            assert scheduler.running, "requests wait while nothing runs"
        if scheduler.running and not out.blocks_to_swap_in:
            # (a request resumed from the CPU may find no room for its next tokens at once)
            assert out.total_num_scheduled_tokens > 0, "running requests but nothing scheduled"

    def check_preemption_takes_the_lowest_priority(self, out: SchedulerOutput, moves: QueueMoves) -> None:
        """Preemption takes the lowest priority (latest arrival) first; the workers drop its sequences;
        by recompute it waits with nothing computed, by swap it waits in the swapped queue."""
        for victim in moves.victims:
            seq_ids = {seq.seq_id for seq in victim.live_seqs}
            assert seq_ids <= set(out.finished_seq_ids), "the workers must drop a preempted sequence"
            assert all(r.sort_key <= victim.sort_key for r in moves.survivors), (
                "a higher priority was preempted"
            )
            if victim.status == RequestStatus.PREEMPTED:
                assert victim in self.scheduler.waiting, "a request preempted by recompute does not wait"
                assert all(seq.num_computed_tokens == 0 for seq in victim.live_seqs), (
                    "a request preempted by recompute kept computed tokens"
                )
            else:
                assert victim in self.scheduler.swapped, "a swapped request is not in the swapped queue"

    def check_nothing_admitted_while_preempting_or_swapped(
        self, out: SchedulerOutput, moves: QueueMoves
    ) -> None:
        if moves.victims:
            assert not moves.admitted and not moves.resumed, (
                "admitted or resumed work in a step that preempted"
            )
            assert not out.blocks_to_swap_in, "swapped in during a step that preempted"
        if self.scheduler.swapped:
            assert not moves.admitted, "admitted new work while a swapped request waits"

    def check_admission_is_fcfs(self, moves: QueueMoves) -> None:
        """Whoever was admitted (or resumed) came before everyone still waiting (or swapped)."""
        for request in moves.admitted:
            assert all(request.sort_key <= w.sort_key for w in self.scheduler.waiting), "admission overtook"
        for request in moves.resumed:
            assert all(request.sort_key <= s.sort_key for s in self.scheduler.swapped), "resumption overtook"

    def check_prefix_hits_are_whole_blocks(self, out: SchedulerOutput, admitted: list[Request]) -> None:
        """A prefix hit is whole blocks and always leaves the last token to compute (none without caching)."""
        admitted_seqs = {seq.seq_id: seq for r in admitted for seq in r.live_seqs}
        for new in out.scheduled_new_seqs:
            if new.seq_id in admitted_seqs and admitted_seqs[new.seq_id].index == 0:
                hit = new.num_computed_tokens
                assert hit % self.sc.block_size == 0, f"{new.seq_id}: a prefix hit of part of a block"
                assert hit < admitted_seqs[new.seq_id].num_tokens, f"{new.seq_id}: the whole prompt was a hit"
                if not self.sc.enable_prefix_caching:
                    assert hit == 0, f"{new.seq_id}: a prefix hit with prefix caching off"

    def record_outputs(self, outputs: list[EngineCoreOutput]) -> None:
        """File the step's outputs; none for an aborted request or a stopped sequence, none after the end."""
        for output in outputs:
            assert output.request_id not in self.aborted, "output for an aborted request"
            key = output_key(output)
            assert key not in self.stopped, "output for a stopped sequence"
            previous = self.outputs.setdefault(key, [])
            assert not any(o.finished for o in previous), f"{key} reported after it finished"
            previous.append(output)
            request = self.requests[output.request_id]
            if output.error and request.status != RequestStatus.FINISHED_IGNORED:
                self.capped.add(output.request_id)

    def check_swap_out(self, out, victims, device_before, seqs_before) -> None:
        """Each swapped request moves each of its blocks once (a block it shares with another swapped
        request by prefix caching moves once per request), and its CPU tables keep its sharing."""
        pairs = out.blocks_to_swap_out
        assert len({cpu for _, cpu in pairs}) == len(pairs), "two blocks swapped into one"
        swapped_victims = [v for v in victims if v.status == RequestStatus.SWAPPED]

        def table_before(victim, seq) -> list[int]:
            if seq.seq_id not in seqs_before:  # forked in this very step: its parent's table
                return device_before.get(victim.seqs[0].seq_id, [])
            return device_before.get(seq.seq_id, [])

        expected = Counter(
            block
            for v in swapped_victims
            for block in {b for seq in v.live_seqs for b in table_before(v, seq)}
        )
        assert Counter(device for device, _ in pairs) == expected
        cpu = swapped_blocks(self.scheduler)
        for victim in swapped_victims:
            where: dict[int, int] = {}
            for seq in victim.live_seqs:
                device_table, cpu_table = table_before(victim, seq), cpu.get(seq.seq_id, [])
                assert len(cpu_table) == len(device_table)
                for device, cpu_block in zip(device_table, cpu_table, strict=True):
                    assert (device, cpu_block) in pairs
                    assert where.setdefault(device, cpu_block) == cpu_block, "sharing lost in the swap"

    def check_swap_in(self, out, resumed, cpu_before) -> None:
        moved = dict(out.blocks_to_swap_in)
        assert len(moved) == len(out.blocks_to_swap_in)
        tables = {seq.seq_id: cpu_before.get(seq.seq_id, []) for r in resumed for seq in r.live_seqs}
        assert set(moved) == {block for table in tables.values() for block in table}
        device = held_blocks(self.scheduler)
        for seq_id, table in tables.items():
            assert len(device.get(seq_id, [])) >= len(table)
            for cpu_block, device_block in zip(table, device.get(seq_id, []), strict=False):
                # Back where it was swapped in, unless the step then copied it (copy-on-write).
                assert (
                    device_block == moved[cpu_block] or (moved[cpu_block], device_block) in out.blocks_to_copy
                )

    # ---- the whole run ---------------------------------------------------------------------------

    def run(self) -> None:
        sc, scheduler = self.sc, self.scheduler
        last_step = max(spec.arrival_step for spec in sc.specs)
        for step_index in range(2000):
            if step_index > last_step and not scheduler.has_unfinished_requests():
                break
            self.add_arrivals(step_index)
            if step_index in sc.stray_aborts:
                scheduler.finish_requests(["never-added"], RequestStatus.FINISHED_ABORTED)
            self.abort(step_index, mid_step=False)
            self.stop(step_index, mid_step=False)
            check_invariants(scheduler)
            self.step(step_index)
        else:
            raise AssertionError("scheduler did not finish")
        assert_all_free(scheduler)
        for i, spec in enumerate(sc.specs):
            self.check_request(f"r{i}", spec)

    def check_request(self, req_id: str, spec: Spec) -> None:
        request = self.requests[req_id]
        assert request.is_finished
        ignored = len(spec.prompt) > self.max_seq_len or spec.num_seqs > self.sc.max_num_seqs
        if ignored:
            if request.status != RequestStatus.FINISHED_IGNORED:  # gone before it came up
                assert req_id in self.aborted or any(key.split("#")[0] == req_id for key in self.stopped)
                assert req_id not in self.outputs
                return
            (output,) = self.outputs[req_id]
            assert output.new_token_ids == [] and output.finish_reason == FinishReason.LENGTH and output.error
            return
        assert request.status != RequestStatus.FINISHED_IGNORED
        if self.sc.fits_alone or (spec.num_seqs == 1 and spec.beam_width is None):
            assert req_id not in self.capped, f"{req_id} was cut short though it fits the cache alone"
        if spec.beam_width is not None:
            self.check_beams(req_id, spec)
            return
        if not (req_id in self.aborted or req_id in self.capped or spec.stop is not None):
            assert len(request.seqs) == spec.num_seqs
        for seq in request.seqs:
            key = seq.seq_id
            outputs = self.outputs.get(key, [])
            emitted = [token for o in outputs for token in o.new_token_ids]
            assert emitted == seq.output_token_ids, "emitted tokens differ from the sequence's"
            expected, reason, cumulative = reference_sequence(
                key,
                spec.prompt,
                token_fn,
                max_tokens=spec.max_tokens,
                eos_token_id=spec.eos,
                max_seq_len=self.max_seq_len,
            )
            if req_id in self.aborted or key in self.stopped or req_id in self.capped:
                assert emitted == expected[: len(emitted)], key
                if key in self.stopped and req_id not in self.capped:
                    assert seq.status == SequenceStatus.FINISHED_STOPPED and not any(
                        o.finished for o in outputs
                    )
                elif req_id in self.aborted and not any(o.finished for o in outputs):
                    assert seq.status == SequenceStatus.FINISHED_ABORTED
                continue
            assert (emitted, outputs[-1].finish_reason) == (expected, reason), key
            assert outputs[-1].error is None
            assert seq.status == (
                SequenceStatus.FINISHED_STOPPED
                if reason == FinishReason.STOP
                else SequenceStatus.FINISHED_LENGTH_CAPPED
            )
            if spec.best_of is not None:  # ranked by cumulative log-probability: it must be right
                assert outputs[-1].cumulative_logprob is not None
                assert abs(outputs[-1].cumulative_logprob - cumulative) < 1e-9

    def check_beams(self, req_id: str, spec: Spec) -> None:
        outputs = [o for key, outs in self.outputs.items() if key.split("#")[0] == req_id for o in outs]
        if req_id in self.aborted or req_id in self.capped:
            assert all(o.finished for o in outputs)
            return
        max_tokens = min(spec.max_tokens, max(self.max_seq_len - len(spec.prompt), 1))
        eos = set() if spec.eos is None else {spec.eos}
        reference = reference_beam_search(spec.prompt, spec.beam_width, max_tokens, eos, spec.length_penalty)
        outputs.sort(key=lambda o: o.index)
        assert [o.index for o in outputs] == list(range(len(reference)))
        assert [o.new_token_ids for o in outputs] == [h.token_ids for h in reference], req_id
        for output, hypothesis in zip(outputs, reference, strict=True):
            assert abs(output.cumulative_logprob - hypothesis.cumulative_logprob) < 1e-9
            assert output.finish_reason == (
                FinishReason.STOP if hypothesis.ended_by_eos else FinishReason.LENGTH
            )
            assert output.error is None


_SETTINGS = {"deadline": None, "suppress_health_check": [HealthCheck.too_slow]}


@settings(max_examples=300, **_SETTINGS)
@given(scenarios(spare_cache_tokens=24, max_requests=8, max_prompt=16))
def test_random_workloads_keep_every_invariant(scenario):
    Run(scenario).run()


@settings(max_examples=200, **_SETTINGS)
@given(pressured_scenarios())
def test_tiny_caches_preempt_and_still_finish_everything(scenario):
    Run(scenario).run()


@settings(max_examples=400, **_SETTINGS)
@given(group_scenarios(fits_alone=True))
def test_groups_and_beams_contend_for_the_cache_and_finish_right(scenario):
    Run(scenario).run()


@settings(max_examples=250, **_SETTINGS)
@given(group_scenarios(fits_alone=False))
def test_groups_and_beams_in_caches_too_small_for_them(scenario):
    Run(scenario).run()
