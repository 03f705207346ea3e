"""Randomized runs of the scheduler against a fake worker, with invariants checked every step.

Each example draws a cache (block size, a few blocks), limits (token budget, sequence cap, model
length), and requests with shared prefixes, priorities, arrival steps and aborts. The "model"
samples a token that depends only on the sequence so far, so every request that is not aborted has
one right answer, computed here by a plain loop (the oracle): preemption, recomputation, chunking
and prefix caching must never change it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.outputs import FinishReason
from engine.request import Request, RequestStatus
from tests.unit.scheduler_helpers import (
    FakeWorker,
    assert_all_free,
    check_invariants,
    collect,
    make_request,
    make_scheduler,
)

VOCAB = 5  # tiny, so that prompts and outputs often share blocks and EOS turns up
EOS = 4


def token_fn(request_id: str, tokens: list[int]) -> int:
    return (sum(tokens) * 31 + len(tokens) * 7) % VOCAB


def oracle(prompt: list[int], max_tokens: int, eos: int | None, max_seq_len: int):
    """What a request must produce: (output tokens, finish reason, ignored)."""
    if len(prompt) > max_seq_len:
        return [], FinishReason.LENGTH, True
    tokens, out = list(prompt), []
    while True:
        token = token_fn("", tokens)
        tokens.append(token)
        out.append(token)
        if eos is not None and token == eos:
            return out, FinishReason.STOP, False
        if len(out) >= max_tokens or len(tokens) >= max_seq_len:
            return out, FinishReason.LENGTH, False


@dataclass
class Spec:
    prompt: list[int]
    max_tokens: int
    priority: int
    arrival_step: int
    eos: int | None
    abort_step: int | None  # abort at this step (if still alive) ...
    abort_mid_step: bool  # ... between schedule() and update_from_output() instead of before


@dataclass
class Scenario:
    block_size: int
    num_blocks: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    enable_prefix_caching: bool
    specs: list[Spec]
    stray_aborts: list[int]  # steps at which an unknown id is aborted


@st.composite
def scenarios(
    draw, spare_cache_tokens: int, max_requests: int, max_prompt: int, max_arrival_step: int = 6
) -> Scenario:
    token = st.integers(0, VOCAB - 2)  # prompts avoid EOS so that it comes from sampling
    prefixes = draw(st.lists(st.lists(token, max_size=max_prompt), min_size=1, max_size=3))
    specs = []
    for _ in range(draw(st.integers(1, max_requests))):
        prompt = draw(st.sampled_from(prefixes)) + draw(st.lists(token, max_size=max_prompt // 2))
        specs.append(
            Spec(
                prompt=prompt or [0],
                max_tokens=draw(st.integers(1, 10)),
                priority=draw(st.integers(0, 2)),
                arrival_step=draw(st.integers(0, max_arrival_step)),
                eos=draw(st.sampled_from([None, EOS])),
                abort_step=draw(st.none() | st.none() | st.integers(0, 25)),
                abort_mid_step=draw(st.booleans()),
            )
        )
    block_size = draw(st.sampled_from([1, 2, 3, 4, 8]))
    # Size the cache around the longest prompt, so that it is often under pressure (preemption)
    # and only sometimes too small for a prompt (ignored requests).
    longest = max(len(spec.prompt) for spec in specs)
    cache_tokens = longest + draw(st.integers(-2, spare_cache_tokens))
    return Scenario(
        block_size=block_size,
        num_blocks=max(1, cache_tokens // block_size),
        max_num_seqs=draw(st.integers(1, 5)),
        max_num_batched_tokens=draw(st.integers(1, 24)),
        max_model_len=draw(st.sampled_from([64, 64, 64, 40, 16, 8, 5])),
        enable_prefix_caching=draw(st.booleans() | st.just(True)),
        specs=specs,
        stray_aborts=draw(st.lists(st.integers(0, 10), max_size=2)),
    )


@st.composite
def pressured_scenarios(draw) -> Scenario:
    """Few blocks, several long-lived requests at once, no early stops: preemption is common."""
    sc = draw(scenarios(spare_cache_tokens=6, max_requests=5, max_prompt=10, max_arrival_step=1))
    specs = [replace(spec, eos=None, max_tokens=max(spec.max_tokens, 4)) for spec in sc.specs]
    block_size = min(sc.block_size, 2)
    longest = max(len(spec.prompt) for spec in specs)
    return replace(
        sc,
        specs=specs,
        max_model_len=64,
        max_num_seqs=max(sc.max_num_seqs, 2),
        block_size=block_size,
        # Room for the longest prompt and a little more: two requests rarely fit side by side.
        num_blocks=longest // block_size + draw(st.integers(1, 3)),
    )


def run_scenario(sc: Scenario) -> None:
    scheduler = make_scheduler(
        num_blocks=sc.num_blocks,
        block_size=sc.block_size,
        max_num_seqs=sc.max_num_seqs,
        max_num_batched_tokens=sc.max_num_batched_tokens,
        max_model_len=sc.max_model_len,
        enable_prefix_caching=sc.enable_prefix_caching,
    )
    worker = FakeWorker(sc.block_size, token_fn, scheduler)
    max_seq_len = min(sc.max_model_len, sc.num_blocks * sc.block_size)
    requests: dict[str, Request] = {}
    aborted: set[str] = set()  # aborted while still alive
    tokens: dict[str, list[int]] = {}
    reasons: dict[str, object] = {}
    errors: dict[str, str | None] = {}
    last_step = max(spec.arrival_step for spec in sc.specs)

    def abort(step_index: int, mid_step: bool) -> None:
        for i, spec in enumerate(sc.specs):
            req_id = f"r{i}"
            if spec.abort_step == step_index and spec.abort_mid_step == mid_step and req_id in requests:
                if not requests[req_id].is_finished:
                    aborted.add(req_id)
                scheduler.finish_requests([req_id], RequestStatus.FINISHED_ABORTED)
                assert requests[req_id].is_finished
                assert req_id not in scheduler.requests

    for step_index in range(2000):
        if step_index > last_step and not scheduler.has_unfinished_requests():
            break
        for i, spec in enumerate(sc.specs):
            if spec.arrival_step == step_index:
                request = make_request(
                    f"r{i}",
                    spec.prompt,
                    max_tokens=spec.max_tokens,
                    eos_token_id=spec.eos,
                    priority=spec.priority,
                    arrival_time=step_index + i / 100,
                )
                requests[request.request_id] = request
                scheduler.add_request(request)
        if step_index in sc.stray_aborts:
            scheduler.finish_requests(["never-added"], RequestStatus.FINISHED_ABORTED)
        abort(step_index, mid_step=False)
        check_invariants(scheduler)

        running_before = {r.request_id: r.sort_key for r in scheduler.running}
        out = scheduler.schedule()
        check_invariants(scheduler)
        # The step's limits.
        assert out.total_num_scheduled_tokens <= sc.max_num_batched_tokens
        assert len(out.num_scheduled_tokens) <= sc.max_num_seqs
        assert all(n >= 1 for n in out.num_scheduled_tokens.values())
        # Progress: waiting work never sits behind an idle engine.
        if scheduler.waiting:
            assert scheduler.running, "requests wait while nothing runs"
        if scheduler.running:
            assert out.total_num_scheduled_tokens > 0, "running requests but nothing scheduled"
        # Preemption takes the lowest priority (latest arrival) first, and blocks admission.
        victims = [
            requests[req_id]
            for req_id in running_before
            if requests[req_id].status == RequestStatus.PREEMPTED
        ]
        survivors = [r for r in scheduler.running if r.request_id in running_before]
        for victim in victims:
            assert victim.num_computed_tokens == 0 and victim in scheduler.waiting
            assert victim.request_id in out.finished_req_ids
            assert all(r.sort_key <= victim.sort_key for r in survivors), "a higher priority was preempted"
        if victims:
            assert not out.scheduled_new_reqs, "admitted new work in a step that preempted"
        # FCFS: whoever was admitted came before everyone still waiting.
        for new in out.scheduled_new_reqs:
            assert all(requests[new.req_id].sort_key <= w.sort_key for w in scheduler.waiting)
            # A prefix hit is whole blocks and always leaves the last token to compute.
            hit = new.num_computed_tokens
            assert hit % sc.block_size == 0 and hit < requests[new.req_id].num_tokens
            if not sc.enable_prefix_caching:
                assert hit == 0

        runner_output = worker.execute(out)
        abort(step_index, mid_step=True)
        outputs = scheduler.update_from_output(out, runner_output)
        check_invariants(scheduler)
        for output in outputs.outputs:
            assert output.request_id not in aborted, "output for an aborted request"
            if output.finished:
                errors[output.request_id] = output.error
        collect(outputs, tokens, reasons)
    else:
        raise AssertionError("scheduler did not finish")

    assert_all_free(scheduler)
    for i, spec in enumerate(sc.specs):
        req_id = f"r{i}"
        request = requests[req_id]
        expected, reason, ignored = oracle(spec.prompt or [0], spec.max_tokens, spec.eos, max_seq_len)
        emitted = tokens.get(req_id, [])
        assert emitted == request.output_token_ids, "emitted tokens differ from the request's"
        if req_id in aborted:
            assert request.status == RequestStatus.FINISHED_ABORTED and req_id not in reasons
            assert emitted == expected[: len(emitted)]
            continue
        assert (emitted, reasons[req_id]) == (expected, reason), req_id
        if ignored:
            assert request.status == RequestStatus.FINISHED_IGNORED and errors[req_id]
        else:
            assert request.status != RequestStatus.FINISHED_IGNORED and errors[req_id] is None
            if reason == FinishReason.STOP:
                assert request.status == RequestStatus.FINISHED_STOPPED
            else:
                assert request.status == RequestStatus.FINISHED_LENGTH_CAPPED


_SETTINGS = {"deadline": None, "suppress_health_check": [HealthCheck.too_slow]}


@settings(max_examples=400, **_SETTINGS)
@given(scenarios(spare_cache_tokens=24, max_requests=8, max_prompt=16))
def test_random_workloads_keep_every_invariant(scenario):
    run_scenario(scenario)


@settings(max_examples=300, **_SETTINGS)
@given(pressured_scenarios())
def test_tiny_caches_preempt_and_still_finish_everything(scenario):
    run_scenario(scenario)
