"""SamplingMetadata: the per-row settings of one step's batch of logits, as the sampler reads them.

Every optional field is None (or empty) when no row of the batch needs it, so that the sampler can
skip the whole step: a batch of plain greedy requests costs one argmax.
"""

from __future__ import annotations

import dataclasses

import torch

from engine.sampling_params import SamplingParams


@dataclasses.dataclass
class SamplingMetadata:
    """Per-row sampling settings of one step's batch of logits; tensors live on the logits' device."""

    temperature: torch.Tensor  # [rows] float32; rows below GREEDY_TEMPERATURE are greedy
    all_greedy: bool
    top_k: torch.Tensor | None  # [rows] int64, vocab size where disabled; None when no row uses it
    top_p: torch.Tensor | None  # [rows] float32, 1 where disabled
    min_p: torch.Tensor | None  # [rows] float32, 0 where disabled
    generators: dict[int, torch.Generator]  # row -> the request's own generator (seeded random rows)
    presence_penalties: torch.Tensor | None  # [rows] float32, 0 where disabled
    frequency_penalties: torch.Tensor | None  # [rows] float32, 0 where disabled
    repetition_penalties: torch.Tensor | None  # [rows] float32, 1 where disabled
    prompt_token_ids: list[list[int]]  # per row; read only for the repetition penalty
    output_token_ids: list[list[int]]  # per row, the tokens generated so far
    min_tokens: dict[int, frozenset[int]]  # row -> token ids to suppress (rows still below min_tokens)
    logit_bias: dict[int, dict[int, float]]  # row -> {token id: bias}
    max_num_logprobs: int | None  # the most logprobs any row asked for; None when no row did


def build_sampling_metadata(
    params: list[SamplingParams],
    prompt_token_ids: list[list[int]],
    output_token_ids: list[list[int]],
    generators: list[torch.Generator | None],
    eos_token_ids: list[int | None],
    vocab_size: int,
    device: torch.device,
) -> SamplingMetadata:
    """Derive the batch's SamplingMetadata from each row's params, tokens, generator and EOS id.

    `eos_token_ids[row]` is the EOS that min_tokens holds back for that row (None: only its
    stop_token_ids). Filters are left out when every row is greedy, since argmax ignores them.
    """
    all_greedy = all(p.is_greedy for p in params)

    def per_row(values: list[float], neutral: float, dtype: torch.dtype) -> torch.Tensor | None:
        if all(value == neutral for value in values):
            return None
        return torch.tensor(values, dtype=dtype, device=device)

    def filter_per_row(values: list[float], neutral: float, dtype: torch.dtype) -> torch.Tensor | None:
        return None if all_greedy else per_row(values, neutral, dtype)

    return SamplingMetadata(
        temperature=torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device),
        all_greedy=all_greedy,
        top_k=filter_per_row([_top_k(p.top_k, vocab_size) for p in params], vocab_size, torch.int64),
        top_p=filter_per_row([p.top_p for p in params], 1.0, torch.float32),
        min_p=filter_per_row([p.min_p for p in params], 0.0, torch.float32),
        # Greedy rows never draw noise, so their generators are left out.
        generators={
            row: generator
            for row, (p, generator) in enumerate(zip(params, generators, strict=True))
            if generator is not None and not p.is_greedy
        },
        presence_penalties=per_row([p.presence_penalty for p in params], 0.0, torch.float32),
        frequency_penalties=per_row([p.frequency_penalty for p in params], 0.0, torch.float32),
        repetition_penalties=per_row([p.repetition_penalty for p in params], 1.0, torch.float32),
        prompt_token_ids=prompt_token_ids,
        output_token_ids=output_token_ids,
        min_tokens=_min_tokens(params, output_token_ids, eos_token_ids),
        logit_bias={row: p.logit_bias for row, p in enumerate(params) if p.logit_bias},
        max_num_logprobs=max((p.logprobs for p in params if p.logprobs is not None), default=None),
    )


def _top_k(top_k: int, vocab_size: int) -> int:
    """A row's k as the filter reads it: the whole vocabulary when disabled (0 or -1) or larger."""
    return vocab_size if top_k <= 0 else min(top_k, vocab_size)


def _min_tokens(
    params: list[SamplingParams], output_token_ids: list[list[int]], eos_token_ids: list[int | None]
) -> dict[int, frozenset[int]]:
    """Row -> the stop tokens (EOS included) it may not emit yet, for rows still below min_tokens."""
    suppressed = {}
    for row, (p, output, eos) in enumerate(zip(params, output_token_ids, eos_token_ids, strict=True)):
        if len(output) >= p.min_tokens:
            continue
        stops = p.all_stop_token_ids if eos is None else p.all_stop_token_ids | {eos}
        if stops:
            suppressed[row] = stops
    return suppressed
