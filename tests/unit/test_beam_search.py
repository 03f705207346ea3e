"""BeamSearchState against small examples worked out by hand (transformers' semantics with
early_stopping=True): the top 2k continuations over all beams, EOS counted only among the first k,
scores normalized by length ** length_penalty, and the search's ends."""

from __future__ import annotations

import pytest

from engine.sched.beam_search import BeamSearchState, Candidate

EOS = 9


def beams(step) -> list[tuple[int, int, float]]:
    return [(c.parent, c.token_id, pytest.approx(c.cumulative_logprob)) for c in step.next_beams]


def hypotheses(state: BeamSearchState) -> list[tuple[list[int], float, float, bool]]:
    return [
        (h.token_ids, pytest.approx(h.cumulative_logprob), pytest.approx(h.score), h.ended_by_eos)
        for h in state.results()
    ]


def test_first_step_takes_the_best_k_from_the_one_beam():
    state = BeamSearchState(beam_width=2, max_tokens=10, length_penalty=1.0, eos_token_ids=frozenset({EOS}))
    step = state.step([[]], [0.0], [[(1, -0.5), (2, -0.7), (3, -3.0), (EOS, -4.0)]])
    assert beams(step) == [(0, 1, -0.5), (0, 2, -0.7)] and not step.done
    assert state.results() == []  # EOS ranked 4th of 2k = 4: below k, ignored


def test_eos_in_the_top_k_finishes_a_hypothesis_and_eos_below_k_is_ignored():
    state = BeamSearchState(beam_width=2, max_tokens=10, length_penalty=1.0, eos_token_ids=frozenset({EOS}))
    state.step([[]], [0.0], [[(1, -0.5), (2, -0.7), (3, -3.0), (EOS, -4.0)]])
    # Beam 0 = [1] (-0.5), beam 1 = [2] (-0.7). Continuations, best first:
    # [1, 9] -0.6, [2, 7] -0.9, [2, 9] -1.0, [1, 4] -1.5, ...
    step = state.step(
        [[1], [2]],
        [-0.5, -0.7],
        [
            [(EOS, -0.1), (4, -1.0), (5, -2.0), (6, -3.0)],
            [(7, -0.2), (EOS, -0.3), (8, -2.5), (4, -2.6)],
        ],
    )
    # [1, 9] ranks 1st (< k): finished, scored -0.6 / 2. [2, 9] ranks 3rd: ignored, though it is
    # better than the running [1, 4]. The two best that go on become the beams.
    assert hypotheses(state) == [([1, EOS], -0.6, -0.3, True)]
    assert beams(step) == [(1, 7, -0.9), (0, 4, -1.5)] and not step.done
    # Beam 0 = [2, 7] (-0.9), beam 1 = [1, 4] (-1.5):
    # [2, 7, 9] -1.2, [2, 7, 1] -1.3, [1, 4, 9] -1.6, [1, 4, 5] -1.7, ...
    step = state.step(
        [[2, 7], [1, 4]],
        [-0.9, -1.5],
        [
            [(EOS, -0.3), (1, -0.4), (2, -5.0), (3, -6.0)],
            [(EOS, -0.1), (5, -0.2), (6, -5.0), (7, -6.0)],
        ],
    )
    # k hypotheses are finished: the search is over (early_stopping=True).
    assert hypotheses(state) == [([1, EOS], -0.6, -0.3, True), ([2, 7, EOS], -1.2, -0.4, True)]
    assert step.done
    assert beams(step) == [(0, 1, -1.3), (1, 5, -1.7)]


def test_a_beam_chosen_twice_appears_twice():
    state = BeamSearchState(beam_width=3, max_tokens=10, length_penalty=1.0, eos_token_ids=frozenset())
    state.step([[]], [0.0], [[(1, -0.1), (2, -0.2), (3, -0.3), (4, -0.4), (5, -0.5), (6, -0.6)]])
    step = state.step(
        [[1], [2], [3]],
        [-0.1, -0.2, -0.3],
        [[(7, -0.1), (8, -0.2)], [(7, -5.0), (8, -6.0)], [(7, -0.05), (8, -7.0)]],
    )
    # [1, 7] -0.2, [1, 8] -0.3, [3, 7] -0.35: beam 0 twice, beam 1 not at all.
    assert beams(step) == [(0, 7, -0.2), (0, 8, -0.3), (2, 7, -0.35)]


@pytest.mark.parametrize(
    ("penalty", "expected"),
    [
        # cumulative -1.0 over 1 token against -1.8 over 3 tokens
        (1.0, [([1, 4, EOS], -1.8, -0.6), ([EOS], -1.0, -1.0)]),
        (2.0, [([1, 4, EOS], -1.8, -0.2), ([EOS], -1.0, -1.0)]),
        (0.0, [([EOS], -1.0, -1.0), ([1, 4, EOS], -1.8, -1.8)]),
        (-1.0, [([EOS], -1.0, -1.0), ([1, 4, EOS], -1.8, -5.4)]),
    ],
)
def test_length_penalty_orders_the_hypotheses(penalty, expected):
    state = BeamSearchState(
        beam_width=2, max_tokens=10, length_penalty=penalty, eos_token_ids=frozenset({EOS})
    )
    step = state.step([[]], [0.0], [[(1, -0.2), (EOS, -1.0), (2, -1.1), (3, -5.0)]])
    assert beams(step) == [(0, 1, -0.2), (0, 2, -1.1)] and not step.done
    step = state.step(
        [[1], [2]], [-0.2, -1.1], [[(4, -0.3), (5, -0.4), (6, -6.0), (7, -7.0)], [(4, -2.0), (5, -3.0)]]
    )
    assert beams(step) == [(0, 4, -0.5), (0, 5, -0.6)] and not step.done
    step = state.step(
        [[1, 4], [1, 5]],
        [-0.5, -0.6],
        [[(EOS, -1.3), (1, -2.0), (2, -3.0), (3, -4.0)], [(EOS, -5.0), (1, -6.0)]],
    )
    assert step.done
    assert [(h.token_ids, h.cumulative_logprob, h.score) for h in state.results()] == [
        (tokens, pytest.approx(cumulative), pytest.approx(score)) for tokens, cumulative, score in expected
    ]


def test_max_tokens_ends_every_candidate_and_the_best_k_are_the_results():
    state = BeamSearchState(beam_width=2, max_tokens=2, length_penalty=1.0, eos_token_ids=frozenset({EOS}))
    step = state.step([[]], [0.0], [[(1, -0.1), (2, -0.2), (3, -0.3), (4, -0.4)]])
    assert beams(step) == [(0, 1, -0.1), (0, 2, -0.2)] and not step.done
    step = state.step(
        [[1], [2]],
        [-0.1, -0.2],
        [[(5, -0.5), (6, -0.6), (7, -0.7), (8, -0.8)], [(EOS, -0.1), (6, -2.0), (7, -3.0), (8, -4.0)]],
    )
    # The last token: every candidate ends; the two best are kept, ended by EOS or by length.
    assert step.done and step.next_beams == []
    assert hypotheses(state) == [([2, EOS], -0.3, -0.15, True), ([1, 5], -0.6, -0.3, False)]


def test_max_tokens_one_ends_at_the_first_step():
    state = BeamSearchState(beam_width=3, max_tokens=1, length_penalty=1.0, eos_token_ids=frozenset())
    step = state.step([[]], [0.0], [[(4, -0.4), (2, -0.2), (3, -0.3), (1, -0.1), (5, -0.5)]])
    assert step.done and step.next_beams == []
    assert [h.token_ids for h in state.results()] == [[1], [2], [3]]
    assert not any(h.ended_by_eos for h in state.results())


def test_k_eos_tokens_at_once_end_the_search():
    state = BeamSearchState(beam_width=2, max_tokens=10, length_penalty=1.0, eos_token_ids=frozenset({8, 9}))
    step = state.step([[]], [0.0], [[(8, -0.1), (9, -0.2), (1, -0.3), (2, -0.4)]])
    assert step.done
    assert hypotheses(state) == [([8], -0.1, -0.1, True), ([9], -0.2, -0.2, True)]


def test_search_goes_on_while_fewer_than_k_are_finished_even_behind_them():
    state = BeamSearchState(beam_width=2, max_tokens=10, length_penalty=1.0, eos_token_ids=frozenset({EOS}))
    step = state.step([[]], [0.0], [[(EOS, -0.1), (1, -3.0), (2, -3.1), (3, -3.2)]])
    # One hypothesis (-0.1); the running beams score far worse, but a slot is still open.
    assert not step.done and beams(step) == [(0, 1, -3.0), (0, 2, -3.1)]
    step = state.step([[1], [2]], [-3.0, -3.1], [[(4, -0.1), (5, -0.2)], [(4, -0.3), (5, -0.4)]])
    assert not step.done and len(state.results()) == 1


def test_no_improvement_possible_ends_the_search_once_k_are_finished():
    # width 1: one finished hypothesis fills the slots; the running beam can no longer beat it.
    state = BeamSearchState(beam_width=1, max_tokens=10, length_penalty=1.0, eos_token_ids=frozenset({EOS}))
    step = state.step([[]], [0.0], [[(1, -0.1), (EOS, -2.0)]])
    assert beams(step) == [(0, 1, -0.1)] and not step.done and state.results() == []
    step = state.step([[1]], [-0.1], [[(EOS, -0.5), (2, -0.6)]])
    assert step.done and beams(step) == [(0, 2, -0.7)]
    assert hypotheses(state) == [([1, EOS], -0.6, -0.3, True)]


def test_candidates_past_2k_are_never_considered():
    # width 1: only the top 2 continuations count; an EOS ranked 3rd cannot finish anything.
    state = BeamSearchState(beam_width=1, max_tokens=10, length_penalty=1.0, eos_token_ids=frozenset({EOS}))
    step = state.step([[]], [0.0], [[(1, -0.1), (2, -0.2), (EOS, -0.3)]])
    assert step.next_beams == [Candidate(0, 1, -0.1)] and state.results() == []


def test_results_are_a_copy():
    state = BeamSearchState(beam_width=1, max_tokens=1, length_penalty=1.0, eos_token_ids=frozenset())
    state.step([[]], [0.0], [[(1, -0.1), (2, -0.2)]])
    state.results().clear()
    assert len(state.results()) == 1
