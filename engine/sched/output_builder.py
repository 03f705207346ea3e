"""Turning what the workers sampled into the core's outputs, one request at a time.

A sampled token is appended to its sequence and checked for a stop (which finishes the sequence
and frees its blocks at once); a beam search request instead advances its beams, and reports them
all once it ends. A request that can never fit reports every live sequence as finished.
"""

from __future__ import annotations

import dataclasses
import time

from engine.outputs import EngineCoreOutput, LogprobsLists, ModelRunnerOutput
from engine.sched.request import Request, SequenceStatus
from engine.sched.sequence_groups import SequenceGroups


@dataclasses.dataclass
class SampledBySequence:
    """A ModelRunnerOutput keyed by seq_id."""

    token_ids: dict[str, list[int]]
    logprobs: dict[str, LogprobsLists | None]
    prompt_logprobs: dict[str, LogprobsLists]

    @classmethod
    def of(cls, runner_output: ModelRunnerOutput) -> SampledBySequence:
        seq_ids = runner_output.seq_ids
        return cls(
            token_ids=dict(zip(seq_ids, runner_output.sampled_token_ids, strict=True)),
            # Empty when no sequence asked for log-probabilities.
            logprobs=dict(zip(seq_ids, runner_output.logprobs, strict=False)),
            prompt_logprobs=runner_output.prompt_logprobs,
        )


class OutputBuilder:
    """Builds each request's EngineCoreOutputs for a step."""

    def __init__(self, groups: SequenceGroups, max_seq_len: int) -> None:
        self.groups = groups
        self.max_seq_len = max_seq_len
        # time.time() of each request's first scheduling, until its first output carries it.
        self._first_scheduled_times: dict[str, float] = {}

    def mark_first_scheduled(self, request_id: str) -> None:
        self._first_scheduled_times[request_id] = time.time()

    def forget_request(self, request_id: str) -> None:
        self._first_scheduled_times.pop(request_id, None)

    def request_outputs(self, request: Request, sampled: SampledBySequence) -> list[EngineCoreOutput]:
        """This step's news of a scheduled request (sequences that finish are finished here)."""
        if request.beam_search is not None:
            news = self.groups.advance_beams(request, sampled.logprobs)
        else:
            news = self._append_tokens(request, sampled)
        if news and request.request_id in self._first_scheduled_times:
            news[0].first_scheduled_time = self._first_scheduled_times.pop(request.request_id)
        if news and not request.live_seqs:
            news[-1].request_finished = True
        return news

    def finish_all(self, request: Request, status: SequenceStatus) -> list[EngineCoreOutput]:
        """Finish every live sequence of a request that can never run, reporting each with no tokens."""
        news = []
        for seq in request.live_seqs:
            self.groups.finish_seq(seq, status)
            news.append(seq.make_output([]))
        news[-1].request_finished = True
        return news

    def _append_tokens(self, request: Request, sampled: SampledBySequence) -> list[EngineCoreOutput]:
        prompt_logprobs = sampled.prompt_logprobs.get(request.seqs[0].seq_id)
        outputs = []
        for seq in list(request.live_seqs):
            token_ids = sampled.token_ids.get(seq.seq_id)
            if not token_ids:
                if seq.index == 0 and prompt_logprobs is not None:  # a prefill chunk that sampled nothing
                    outputs.append(seq.make_output([], prompt_logprobs=prompt_logprobs))
                continue
            seq_logprobs = sampled.logprobs.get(seq.seq_id)
            for i, token_id in enumerate(token_ids):
                seq.append_output_token(token_id, seq_logprobs.logprobs[i][0] if seq_logprobs else None)
                status = seq.check_stop(self.max_seq_len)
                if status is not None:
                    self.groups.finish_seq(seq, status)
                    break
            outputs.append(
                seq.make_output(
                    token_ids[: i + 1],
                    seq_logprobs.slice(0, i + 1) if seq_logprobs else None,
                    prompt_logprobs if seq.index == 0 else None,
                )
            )
        return outputs
