"""How one layer attends, beyond the batch's layout: the score scale, the sliding window and the
soft cap. Every backend takes an `AttentionParams` per call; the torch helpers here are the one
statement of the window's and the cap's arithmetic that the torch paths share."""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor


@dataclasses.dataclass(frozen=True)
class AttentionParams:
    """One attention layer's constants.

    sliding_window: a query at position p sees the keys at p - sliding_window + 1 .. p (transformers'
    mask `kv_idx > q_idx - sliding_window`); None: every key up to p.
    logits_soft_cap: the scaled scores become cap * tanh(score / cap) before masking and the softmax
    (Gemma 2); None: no cap.
    """

    scale: float
    sliding_window: int | None = None
    logits_soft_cap: float | None = None

    def __post_init__(self) -> None:
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be at least 1, got {self.sliding_window}")
        if self.logits_soft_cap is not None and self.logits_soft_cap <= 0:
            raise ValueError(f"logits_soft_cap must be positive, got {self.logits_soft_cap}")

    @property
    def plain(self) -> bool:
        """Causal attention over every earlier key with uncapped scores (what every kernel serves)."""
        return self.sliding_window is None and self.logits_soft_cap is None

    @property
    def window_or_zero(self) -> int:
        """The window as the C++ and Triton kernels take it: 0 for none."""
        return self.sliding_window or 0

    @property
    def soft_cap_or_zero(self) -> float:
        """The soft cap as the C++ and Triton kernels take it: 0 for none."""
        return self.logits_soft_cap or 0.0

    def first_visible(self, position: int) -> int:
        """The first key position a query at `position` sees."""
        return 0 if self.sliding_window is None else max(position - self.sliding_window + 1, 0)


def cap_scores(scores: Tensor, params: AttentionParams) -> Tensor:
    """Scaled scores soft-capped (a new tensor), or `scores` itself without a cap."""
    cap = params.logits_soft_cap
    return scores if cap is None else torch.tanh(scores / cap) * cap


def visible_keys(query_positions: Tensor, key_positions: Tensor, params: AttentionParams) -> Tensor:
    """Which keys each query sees (causal, and inside the window if any): positions [..., queries]
    and [..., keys] (broadcast against each other) give [..., queries, keys] bools."""
    queries, keys = query_positions.unsqueeze(-1), key_positions.unsqueeze(-2)
    visible = keys <= queries
    if params.sliding_window is not None:
        visible &= keys > queries - params.sliding_window
    return visible
