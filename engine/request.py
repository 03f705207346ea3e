"""A request as the scheduler sees it: its tokens, how many are in the KV cache, and its status."""

from __future__ import annotations

import enum

from engine.outputs import EngineCoreRequest, FinishReason
from engine.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    """Lifecycle of a request; every status after PREEMPTED is final."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH_CAPPED = 4
    FINISHED_ABORTED = 5
    FINISHED_IGNORED = 6

    @property
    def is_finished(self) -> bool:
        return self > RequestStatus.PREEMPTED

    @property
    def finish_reason(self) -> FinishReason | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH_CAPPED: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    # vLLM reports a prompt it could never schedule as cut short by length.
    RequestStatus.FINISHED_IGNORED: FinishReason.LENGTH,
}


class Request:
    """Scheduler-side state of one request.

    `num_computed_tokens` counts the tokens whose keys and values are in the KV cache (or are being
    computed by the step in flight); the scheduler's whole job is to make it catch up with
    `num_tokens`, which covers prefill, chunked prefill, prefix-cache hits and decode alike.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_id: int | None,
        arrival_time: float,
        priority: int = 0,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.arrival_time = arrival_time
        self.priority = priority
        self.status = RequestStatus.WAITING
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        # Tokens found in the prefix cache at first admission (reported to the user).
        self.num_cached_tokens = -1
        self.num_preemptions = 0
        self.stop_reason: int | str | None = None
        self.error: str | None = None

    @classmethod
    def from_engine_core_request(cls, request: EngineCoreRequest) -> Request:
        return cls(
            request.request_id,
            request.prompt_token_ids,
            request.sampling_params,
            request.eos_token_id,
            request.arrival_time,
            request.priority,
        )

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def sort_key(self) -> tuple[int, float]:
        """Lower runs first: priority, then arrival (FCFS)."""
        return (self.priority, self.arrival_time)

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, "
            f"tokens={self.num_computed_tokens}/{self.num_tokens})"
        )
