"""Batched sampling: one pass over the whole batch, per-request parameters as tensors.

vLLM v1's order of operations: logprobs of the raw logits; min_tokens and logit_bias; penalties;
then greedy rows take the argmax while random rows are divided by their temperature, filtered by
min_p, top-k and top-p, and drawn. Every step that no row of the batch needs is skipped.

Random rows are drawn by inverse CDF (the first token whose cumulative probability passes a
uniform number), one random number per row: a seeded row's is a function of its seed and output
position computed on the device (engine/sample/counter_random.py), so its tokens do not depend on
what else shares the batch, and no step waits on the host to seed anything.
"""

from __future__ import annotations

import dataclasses

import torch

from engine.sample.counter_random import splitmix64_uniform
from engine.sample.metadata import SamplingMetadata
from engine.sample.processors import (
    apply_logit_bias,
    apply_min_p,
    apply_min_tokens,
    apply_penalties,
    apply_top_k_top_p,
)
from engine.sampling_params import GREEDY_TEMPERATURE
from kernels.fused_ops import argmax_rows

__all__ = [
    "LogprobsTensors",
    "Sampler",
    "SamplerOutput",
    "SamplingMetadata",
    "apply_top_k_top_p",
    "compute_logprobs",
    "greedy_tokens",
]


@dataclasses.dataclass
class LogprobsTensors:
    """Logprobs of one token per row plus each row's top-k; column 0 is the row's own token."""

    token_ids: torch.Tensor  # [rows, k + 1] int64: the sampled (or given) token, then the top-k
    logprobs: torch.Tensor  # [rows, k + 1] float32, same layout
    ranks: torch.Tensor  # [rows] int64: rank of the column-0 token, 1 for the most likely

    def parts(self) -> list[torch.Tensor]:
        """The three tensors, in the order the constructor takes them."""
        return [self.token_ids, self.logprobs, self.ranks]

    def tolists(self) -> tuple[list[list[int]], list[list[float]], list[int]]:
        """The three tensors as Python lists (token ids, logprobs, ranks)."""
        return self.token_ids.tolist(), self.logprobs.tolist(), self.ranks.tolist()


@dataclasses.dataclass
class SamplerOutput:
    """One step's sampled tokens, with their logprobs when some row asked for them."""

    sampled_token_ids: torch.Tensor  # [rows] int64
    logprobs: LogprobsTensors | None


def compute_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, num_logprobs: int) -> LogprobsTensors:
    """Logprob and rank of each row's `token_ids` entry, plus the row's top `num_logprobs`, taken
    from the log-softmax of the raw logits (also what prompt logprobs use)."""
    return _gather_logprobs(logits.float().log_softmax(dim=-1), token_ids, num_logprobs)


def _gather_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor, num_logprobs: int) -> LogprobsTensors:
    top_logprobs, top_ids = logprobs.topk(num_logprobs, dim=-1)
    token_ids = token_ids.long().unsqueeze(1)
    token_logprobs = logprobs.gather(1, token_ids)
    ranks = (logprobs > token_logprobs).sum(dim=-1) + 1
    return LogprobsTensors(
        token_ids=torch.cat((token_ids, top_ids), dim=1),
        logprobs=torch.cat((token_logprobs, top_logprobs), dim=1),
        ranks=ranks,
    )


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """The argmax of each row ([rows, vocab] -> [rows] int64), ties to the lowest token id, NaN as
    the maximum: one vectorized C++ pass per row on the CPU (kernels/fused_ops.py), on the logits'
    own dtype with no float32 copy (tests/unit/test_sampler.py checks it against plain Python)."""
    return argmax_rows(logits)


def _is_plain_greedy(meta: SamplingMetadata) -> bool:
    """Every row greedy, and nothing (log-probabilities, min_tokens, logit bias, penalties) that
    needs the logits processed or widened to float32 first."""
    return (
        meta.all_greedy
        and meta.max_num_logprobs is None
        and not meta.min_tokens
        and not meta.logit_bias
        and meta.repetition_penalties is None
        and meta.frequency_penalties is None
        and meta.presence_penalties is None
    )


class Sampler:
    """Turns a batch of logits into one token per row (and its logprobs when asked for)."""

    def __init__(self, generator: torch.Generator) -> None:
        self.generator = generator  # noise for rows without a seed of their own

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        """Sample one token per row of `logits` ([rows, vocab]) under the rows' settings in `meta`."""
        if _is_plain_greedy(meta):
            return SamplerOutput(greedy_tokens(logits), None)
        # Widened first: the processors and the softmax work in float32.
        logits = logits.float()
        # vLLM's default "raw_logprobs": what the model said, before any processing.
        raw_logprobs = None if meta.max_num_logprobs is None else logits.log_softmax(dim=-1)
        logits = apply_min_tokens(logits, meta.min_tokens)
        logits = apply_logit_bias(logits, meta.logit_bias)
        logits = apply_penalties(logits, meta)
        sampled = self._sample(logits, meta)
        if raw_logprobs is None:
            return SamplerOutput(sampled, None)
        return SamplerOutput(sampled, _gather_logprobs(raw_logprobs, sampled, meta.max_num_logprobs))

    def _sample(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        greedy = greedy_tokens(logits)
        if meta.all_greedy:
            return greedy
        is_greedy = meta.temperature < GREEDY_TEMPERATURE
        # Greedy rows divide by 1: their draw is thrown away, but must not overflow.
        logits = logits / torch.where(is_greedy, 1.0, meta.temperature).unsqueeze(1)
        if meta.min_p is not None:
            logits = apply_min_p(logits, meta.min_p)
        logits = apply_top_k_top_p(logits, meta.top_k, meta.top_p)
        sampled = self._inverse_cdf(logits.softmax(dim=-1), meta)
        return torch.where(is_greedy, greedy, sampled)

    def _inverse_cdf(self, probs: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """One draw per row from `probs`: the first token whose cumulative probability passes a
        uniform number. One random number per row, not one per vocabulary entry as the
        exponential race needs; seeded rows take theirs from their keys."""
        uniform = torch.rand(probs.shape[0], generator=self.generator, device=probs.device)
        if meta.seed_keys is not None:
            uniform = torch.where(meta.seeded, splitmix64_uniform(meta.seed_keys), uniform)
        cumulative = probs.cumsum(dim=-1)
        # Scaled by the row's total, so float rounding in the cumsum can never leave u above it.
        targets = uniform.unsqueeze(1) * cumulative[:, -1:]
        sampled = torch.searchsorted(cumulative, targets, right=True).squeeze(1)
        return sampled.clamp_(max=probs.shape[1] - 1)
