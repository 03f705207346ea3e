"""Beam search through the scheduler: the beams against a plain reference search, forks and pruning
with shared blocks, swap pressure, max_model_len and abort (block size 4 unless said).
"""

from __future__ import annotations

import pytest

from engine.outputs import FinishReason
from engine.sched.request import RequestStatus, SequenceStatus
from tests.unit.reference_beam_search import reference_beam_search
from tests.unit.scheduler_helpers import (
    block_ref_counts,
    indexed_scheduler_and_worker,
    make_beam_request,
    outputs_by_key,
    step,
)
from tests.unit.scheduler_invariants import (
    assert_all_free,
    held_blocks,
)

setup = indexed_scheduler_and_worker
by_key = outputs_by_key
refs = block_ref_counts


# ---- beam search ----------------------------------------------------------------------------------

EOS = 3


def run_beam_search(scheduler, worker, request):
    scheduler.add_request(request)
    results = []
    while scheduler.has_unfinished_requests():
        _out, outputs = step(scheduler, worker)
        live = request.live_seqs
        assert len(live) <= request.beam_search.beam_width
        if outputs.outputs:
            assert request.is_finished  # beams are reported once, at the end
            results += outputs.outputs
    assert_all_free(scheduler)
    return results


def assert_same_hypotheses(results, reference, request_id="r"):
    assert [o.index for o in results] == list(range(len(reference)))
    assert [(o.request_id, o.new_token_ids) for o in results] == [
        (request_id, h.token_ids) for h in reference
    ]
    assert [o.cumulative_logprob for o in results] == pytest.approx([h.cumulative_logprob for h in reference])
    assert [o.finish_reason for o in results] == [
        FinishReason.STOP if h.ended_by_eos else FinishReason.LENGTH for h in reference
    ]


BEAM_CASES = [
    # (prompt, beam_width, max_tokens, length_penalty, eos)
    ([1, 2, 3, 4, 5], 1, 5, 1.0, EOS),
    ([1, 2, 3, 4, 5], 2, 6, 1.0, EOS),
    ([1, 2, 3, 4, 5], 3, 8, 1.0, EOS),
    ([7, 6], 3, 8, 0.5, EOS),
    ([7, 6], 3, 8, 2.0, EOS),
    ([0, 0, 1], 2, 7, -1.0, EOS),
    ([4, 4, 4, 4], 3, 6, 1.0, None),
    *[([seed, 5, seed + 1], 3, 7, 1.0, EOS) for seed in range(6)],
    *[([seed, 2], 2, 5, 1.0, seed % 8) for seed in range(6)],
]


@pytest.mark.parametrize(("prompt", "width", "max_tokens", "penalty", "eos"), BEAM_CASES)
@pytest.mark.parametrize("block_size", [1, 4])
def test_beam_search_matches_a_plain_reference(prompt, width, max_tokens, penalty, eos, block_size):
    scheduler, worker = setup(num_blocks=64, block_size=block_size)
    request = make_beam_request(
        "r", prompt, beam_width=width, max_tokens=max_tokens, eos_token_id=eos, length_penalty=penalty
    )
    results = run_beam_search(scheduler, worker, request)
    eos_ids = set() if eos is None else {eos}
    reference = reference_beam_search(prompt, width, max_tokens, eos_ids, penalty)
    assert reference  # the reference always finishes something
    assert_same_hypotheses(results, reference)


def test_beam_search_forks_and_prunes_with_shared_blocks():
    scheduler, worker = setup(num_blocks=64)
    request = make_beam_request("r", [1, 2, 3, 4, 5], beam_width=3, max_tokens=8, eos_token_id=None)
    scheduler.add_request(request)
    out, outputs = step(scheduler, worker)  # the prompt: 5 tokens, blocks 0 and 1
    (new,) = out.scheduled_new_seqs
    assert new.num_logprobs == 6 and new.sampling_params.temperature == 0.0
    assert outputs.outputs == [] and len(request.live_seqs) == 3  # the first step chose three beams
    # All three beams still share the prompt's blocks until they write.
    assert set(map(tuple, held_blocks(scheduler).values())) == {(0, 1)}
    assert refs(scheduler)[:2] == [3, 3]
    out, _ = step(scheduler, worker)
    assert len(out.blocks_to_copy) == 2  # the partial block 1: two copies for three writers
    seen_pruned = False
    while scheduler.has_unfinished_requests():
        step(scheduler, worker)
        seen_pruned |= any(seq.status == SequenceStatus.FINISHED_PRUNED for seq in request.seqs)
    assert seen_pruned  # some beam was dropped along the way (and its blocks freed: checked each step)
    assert_all_free(scheduler)


def test_beam_search_under_swap_pressure_gives_the_same_beams():
    prompt = [1, 2, 3, 4, 5]
    reference = {
        rid: reference_beam_search([*prompt, i], 3, 8, {EOS}, 1.0) for i, rid in enumerate(["x", "y", "z"])
    }
    for kwargs in ({"num_cpu_blocks": 16}, {"num_cpu_blocks": 16, "preemption_mode": "recompute"}):
        scheduler, worker = setup(
            num_blocks=12, block_size=2, max_num_seqs=9, max_num_batched_tokens=8, **kwargs
        )
        for i, rid in enumerate(["x", "y", "z"]):
            scheduler.add_request(
                make_beam_request(
                    rid, [*prompt, i], beam_width=3, max_tokens=8, eos_token_id=EOS, arrival_time=i
                )
            )
        results: dict = {}
        swapped = False
        while scheduler.has_unfinished_requests():
            out, outputs = step(scheduler, worker)
            swapped |= bool(out.blocks_to_swap_out)
            for output in outputs.outputs:
                assert output.error is None  # each request alone fits (12 blocks at most)
                results.setdefault(output.request_id, []).append(output)
        assert scheduler.num_preemptions > 0 and swapped == ("preemption_mode" not in kwargs)
        for rid, hypotheses in reference.items():
            assert_same_hypotheses(results[rid], hypotheses, rid)
        assert_all_free(scheduler)


def test_beam_search_stops_at_max_model_len():
    scheduler, worker = setup(num_blocks=64, max_model_len=8)
    request = make_beam_request("r", [1, 2, 3, 4, 5], beam_width=2, max_tokens=10, eos_token_id=None)
    results = run_beam_search(scheduler, worker, request)
    # 5 prompt tokens and at most 3 generated (the last one sampled, not computed): as a sampled
    # request, which stops at 8 tokens.
    assert_same_hypotheses(results, reference_beam_search([1, 2, 3, 4, 5], 2, 3, set(), 1.0))
    assert all(len(o.new_token_ids) == 3 for o in results)


def test_aborting_a_beam_search_frees_every_beam():
    scheduler, worker = setup(num_blocks=64)
    request = make_beam_request("r", [1, 2, 3, 4, 5], beam_width=3, max_tokens=8, eos_token_id=None)
    scheduler.add_request(request)
    for _ in range(3):
        step(scheduler, worker)
    assert len(request.live_seqs) == 3
    scheduler.finish_requests(["r"], RequestStatus.FINISHED_ABORTED)
    assert_all_free(scheduler)
    out, outputs = step(scheduler, worker)
    assert len(out.finished_seq_ids) == 3 and outputs.outputs == []
