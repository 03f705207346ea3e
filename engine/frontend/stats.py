"""What the front end measures about requests, for the server's metrics and periodic log.

The core reports `SchedulerStats` (queue lengths, KV cache usage) with every batch of outputs; the
front end adds what only it can time: time to first token, inter-token latency, end-to-end latency
and queueing time, measured against each request's arrival. Every time is `time.time()`: the core's
first-scheduled timestamp is compared with the front end's arrival time, and both run on one host.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

from engine.outputs import EngineCoreOutput, SchedulerStats


@dataclasses.dataclass
class FinishedRequestStats:
    """One request that ended: why, how long it took end to end and in the queue, its token counts."""

    finish_reason: str
    e2e_latency: float
    queued_time: float
    num_prompt_tokens: int
    num_generation_tokens: int


@dataclasses.dataclass
class IterationStats:
    """What one batch of core outputs brought.

    `num_prompt_tokens` counts the prompts of the requests that got their first token in this batch;
    `num_generation_tokens` every new token; `time_to_first_tokens` one entry per such request;
    `inter_token_latencies` one entry per sequence that got a token and had one before.
    """

    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    time_to_first_tokens: list[float] = dataclasses.field(default_factory=list)
    inter_token_latencies: list[float] = dataclasses.field(default_factory=list)
    finished_requests: list[FinishedRequestStats] = dataclasses.field(default_factory=list)


class StatLogger(Protocol):
    """Receives the stats of every batch of outputs (Prometheus metrics, a periodic log line)."""

    def record(self, scheduler_stats: SchedulerStats | None, iteration_stats: IterationStats) -> None: ...


class RequestTimes:
    """The clock of one request in the front end: arrival, first scheduling, tokens so far."""

    def __init__(self, arrival_time: float, num_prompt_tokens: int) -> None:
        self.arrival_time = arrival_time
        self.num_prompt_tokens = num_prompt_tokens
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.last_token_times: dict[int, float] = {}  # per sequence index
        self.num_generation_tokens = 0

    def observe(
        self, output: EngineCoreOutput, num_new_tokens: int, now: float, stats: IterationStats
    ) -> None:
        """Account for `num_new_tokens` tokens of one sequence that reached the user at `now`."""
        if output.first_scheduled_time is not None and self.first_scheduled_time is None:
            self.first_scheduled_time = output.first_scheduled_time
        if not num_new_tokens:
            return
        stats.num_generation_tokens += num_new_tokens
        self.num_generation_tokens += num_new_tokens
        if self.first_token_time is None:
            self.first_token_time = now
            stats.num_prompt_tokens += self.num_prompt_tokens
            stats.time_to_first_tokens.append(now - self.arrival_time)
        else:
            last = self.last_token_times.get(output.index)
            if last is not None:  # a sequence forked this step has no previous token of its own
                stats.inter_token_latencies.append(now - last)
        self.last_token_times[output.index] = now

    def finish(self, finish_reason: str, now: float) -> FinishedRequestStats:
        # A request never scheduled (aborted while waiting, or too long to ever run) queued until now.
        scheduled = self.first_scheduled_time if self.first_scheduled_time is not None else now
        return FinishedRequestStats(
            finish_reason=finish_reason,
            e2e_latency=now - self.arrival_time,
            queued_time=max(scheduled - self.arrival_time, 0.0),
            num_prompt_tokens=self.num_prompt_tokens,
            num_generation_tokens=self.num_generation_tokens,
        )
