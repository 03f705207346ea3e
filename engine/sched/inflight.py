"""The steps in flight: which sequences each was scheduled for, and the placeholder tokens it owes.

A step's output can come back after the sequences it ran for have changed: under async scheduling
(the next step is planned before this one returns) and with pipeline stages (several steps are in
flight at once). Two things then need remembering:
- the Sequence objects a step was scheduled for, since a finished request's id may have been taken
  by a new request by the time the step's tokens arrive, and those tokens are the old one's;
- the placeholders: a sequence scheduled again before the token its last step samples is known
  counts that token as pending (`Sequence.num_pending_tokens`), filled when the output arrives.
"""

from __future__ import annotations

from engine.outputs import SchedulerOutput
from engine.sched.output_builder import SampledBySequence
from engine.sched.request import Request, Sequence


class InflightSteps:
    """The sequences of each step with tokens, by id() of its SchedulerOutput, until its output is
    applied; and the placeholder bookkeeping of async scheduling."""

    def __init__(self, async_scheduling: bool) -> None:
        self.async_scheduling = async_scheduling
        self._seqs: dict[int, dict[str, Sequence]] = {}

    def record(self, scheduler_output: SchedulerOutput, seqs: dict[str, Sequence]) -> None:
        """Remember the sequences a step with tokens was scheduled for."""
        if scheduler_output.num_scheduled_tokens:
            self._seqs[id(scheduler_output)] = {
                seq_id: seqs[seq_id] for seq_id in scheduler_output.num_scheduled_tokens
            }

    def take(self, scheduler_output: SchedulerOutput) -> dict[str, Sequence]:
        """The sequences a returning step was scheduled for (forgotten from now on)."""
        return self._seqs.pop(id(scheduler_output), {})

    def add_placeholder(self, request: Request, seq: Sequence) -> None:
        """After `seq` was scheduled: under async scheduling, a step that reaches its last token
        (known or pending) samples the next one, pending until the step returns."""
        if (
            self.async_scheduling
            and request.runs_on_placeholders
            and seq.num_computed_tokens == seq.num_tokens + seq.num_pending_tokens
        ):
            seq.num_pending_tokens += 1

    @staticmethod
    def fill_placeholder(seq: Sequence, sampled: SampledBySequence) -> bool:
        """Whether the returning step sampled a token `seq` held a placeholder for (now filled)."""
        filled = seq.num_pending_tokens > 0 and seq.seq_id in sampled.token_ids
        if filled:
            seq.num_pending_tokens -= 1
        return filled


def has_pending_tokens(request: Request) -> bool:
    """A request preempted while a step sampled for it: it resumes once that token is known."""
    return any(seq.num_pending_tokens for seq in request.live_seqs)
