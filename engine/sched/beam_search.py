"""Beam selection for one request, step by step, with transformers' semantics.

This is the decision half of beam search, free of any KV-cache concern: given each live beam's
cumulative log-probability and its top-2k next tokens, it picks the next live beams and the
finished hypotheses exactly as `transformers`' `_beam_search` does with `do_sample=False` and
`early_stopping=True` (its vectorized implementation in transformers 5):

- the 2k best continuations over all beams are ranked by cumulative log-probability;
- the best k that do not end the sequence (EOS, or reaching max_tokens) become the next beams;
- an ending continuation ranked among the first k becomes a finished hypothesis, scored by its
  cumulative log-probability / (generated length ** length_penalty), unless k hypotheses are
  already finished or no running beam can still beat the worst of them;
- the search ends when k hypotheses are finished, no improvement is possible, or every candidate
  ends its sequence.

The scheduler applies the decisions: forking a beam chosen twice, freeing beams not chosen.
"""

from __future__ import annotations

import dataclasses

# transformers marks impossible candidates with this score instead of -inf.
_EXCLUDED = -1.0e9


@dataclasses.dataclass
class Hypothesis:
    """A finished beam: its generated tokens (the ending token included) and its scores."""

    token_ids: list[int]
    cumulative_logprob: float
    score: float
    ended_by_eos: bool


@dataclasses.dataclass
class Candidate:
    """One continuation: beam `parent` (an index into the live beams) extended by `token_id`."""

    parent: int
    token_id: int
    cumulative_logprob: float


@dataclasses.dataclass
class BeamStep:
    """The outcome of one step: the next live beams, in rank order, and whether the search is over."""

    next_beams: list[Candidate]
    done: bool


class BeamSearchState:
    """Finished hypotheses and the stopping heuristic of one request's beam search."""

    def __init__(
        self, beam_width: int, max_tokens: int, length_penalty: float, eos_token_ids: frozenset[int]
    ) -> None:
        self.beam_width = beam_width
        self.max_tokens = max_tokens
        self.length_penalty = length_penalty
        self.eos_token_ids = eos_token_ids
        self.finished: list[Hypothesis] = []
        self.num_generated = 0
        self._improvement_possible = True

    def step(
        self,
        beam_outputs: list[list[int]],
        beam_logprobs: list[float],
        candidates: list[list[tuple[int, float]]],
    ) -> BeamStep:
        """Advance by one token.

        beam_outputs[i]: tokens beam i generated so far; beam_logprobs[i]: its cumulative
        log-probability; candidates[i]: its top (token, log-probability) continuations, at least
        2 x beam_width of them (fewer only when the vocabulary is smaller).
        """
        width = self.beam_width
        ranked = sorted(
            (
                Candidate(parent, token, beam_logprobs[parent] + logprob)
                for parent, options in enumerate(candidates)
                for token, logprob in options
            ),
            key=lambda c: c.cumulative_logprob,
            reverse=True,
        )[: 2 * width]
        last_step = self.num_generated + 1 >= self.max_tokens
        ends = [last_step or c.token_id in self.eos_token_ids for c in ranked]
        running = [c for c, end in zip(ranked, ends, strict=True) if not end][:width]
        self._add_hypotheses(beam_outputs, ranked, ends)
        self.num_generated += 1
        if running:
            best = running[0].cumulative_logprob / self.num_generated**self.length_penalty
            full = len(self.finished) == width
            self._improvement_possible &= not full or best > min(h.score for h in self.finished)
        done = not self._improvement_possible or len(self.finished) == width or all(ends)
        return BeamStep(running, done)

    def _add_hypotheses(
        self, beam_outputs: list[list[int]], ranked: list[Candidate], ends: list[bool]
    ) -> None:
        if len(self.finished) == self.beam_width or not self._improvement_possible:
            return
        length = (self.num_generated + 1) ** self.length_penalty
        for rank, (candidate, end) in enumerate(zip(ranked, ends, strict=True)):
            if end and rank < self.beam_width:
                self.finished.append(
                    Hypothesis(
                        [*beam_outputs[candidate.parent], candidate.token_id],
                        candidate.cumulative_logprob,
                        candidate.cumulative_logprob / length,
                        candidate.token_id in self.eos_token_ids,
                    )
                )
        # Stable sort: among equal scores, earlier hypotheses (as transformers merges them) stay first.
        self.finished.sort(key=lambda h: h.score, reverse=True)
        del self.finished[self.beam_width :]

    def results(self) -> list[Hypothesis]:
        """The finished hypotheses, best first."""
        return list(self.finished)
