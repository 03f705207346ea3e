"""SamplingParams: how one request picks its tokens and when it stops (vLLM's names and defaults).

A msgspec Struct so that it crosses process boundaries inside `EngineCoreRequest` without pickle.
Every check runs at construction and raises `ValueError` naming the field and its limit.
"""

from __future__ import annotations

import msgspec

# Below this temperature sampling is greedy, as in vLLM: dividing logits by ~0 would overflow.
GREEDY_TEMPERATURE = 1e-5


class SamplingParams(msgspec.Struct, omit_defaults=True, kw_only=True):
    """Sampling and stopping settings of one request."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}.")
        if self.n > 1:
            raise ValueError(f"n must be 1: parallel sampling is not available yet, got {self.n}.")
        if self.temperature < 0.0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}.")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")
        if self.top_k < -1:
            raise ValueError(f"top_k must be 0 or -1 (disable), or at least 1, got {self.top_k}.")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}.")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise ValueError(f"seed must be in [0, 2**63), got {self.seed}.")
        if self.stop_token_ids is not None and any(t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative, got {self.stop_token_ids}.")
        if self.temperature < GREEDY_TEMPERATURE:
            # Greedy: the filters cannot change the argmax, so drop them (vLLM does the same).
            self.top_p, self.top_k = 1.0, 0

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def all_stop_token_ids(self) -> frozenset[int]:
        return frozenset(self.stop_token_ids or ())
