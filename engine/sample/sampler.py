"""Batched sampling: one pass over the whole batch, per-request parameters as tensors.

Random rows are drawn with the exponential-race trick (argmax of probs / Exp(1) noise is a sample
from probs), which lets each seeded request draw its noise from its own generator: its tokens then
do not depend on what else shares the batch.
"""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass
class SamplingMetadata:
    """Per-row sampling settings of one step's batch of logits."""

    temperature: torch.Tensor  # [rows] float32; rows below GREEDY_TEMPERATURE are greedy
    all_greedy: bool
    top_k: torch.Tensor | None  # [rows] int64, vocab size where disabled; None when no row uses it
    top_p: torch.Tensor | None  # [rows] float32; None when no row uses it
    generators: dict[int, torch.Generator]  # row -> the request's own generator (seeded requests)


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Mask (to -inf) every logit outside each row's top-k and top-p nucleus."""
    if top_k is None and top_p is None:
        return logits
    sorted_logits, order = logits.sort(dim=-1)  # ascending: the kept tokens are at the end
    vocab = logits.shape[-1]
    if top_k is not None:
        kth = sorted_logits.gather(1, (vocab - top_k).clamp(0, vocab - 1).unsqueeze(1))
        sorted_logits.masked_fill_(sorted_logits < kth, float("-inf"))
    if top_p is not None:
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop = cumulative <= (1 - top_p).unsqueeze(1)
        drop[:, -1] = False  # the most likely token always stays
        sorted_logits.masked_fill_(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


class Sampler:
    """Turns a batch of logits into one token per row."""

    def __init__(self, generator: torch.Generator) -> None:
        self.generator = generator  # noise for rows without a seed of their own

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        logits = logits.float()
        greedy = logits.argmax(dim=-1)
        if meta.all_greedy:
            return greedy
        is_greedy = meta.temperature < 1e-5
        temperature = torch.where(is_greedy, torch.ones_like(meta.temperature), meta.temperature)
        logits = apply_top_k_top_p(logits / temperature.unsqueeze(1), meta.top_k, meta.top_p)
        probs = logits.softmax(dim=-1)
        noise = torch.empty_like(probs).exponential_(generator=self.generator)
        for row, generator in meta.generators.items():
            noise[row].exponential_(generator=generator)
        sampled = (probs / noise).argmax(dim=-1)
        return torch.where(is_greedy, greedy, sampled)
