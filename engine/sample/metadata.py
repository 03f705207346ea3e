"""SamplingMetadata: the per-row settings of one step's batch of logits, as the sampler reads them.

The numeric settings of each row (temperature, top-p, min-p, the penalties, top-k) are columns of
two tensors on the logits' device: the model runner keeps them per sequence in its persistent batch
and gathers the step's rows on the device; a one-off batch packs them with `sampling_values`. Every
optional field is None (or empty) when no row of the batch needs it, so that the sampler can skip
the whole step: a batch of plain greedy requests costs one argmax.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from engine.sample.counter_random import as_int64_keys
from engine.sampling_params import SamplingParams
from engine.transfers import host_to_device

# The float columns of SamplingValues.floats, in order, and the value at which each does nothing.
FLOAT_COLUMNS = (
    "temperature",
    "top_p",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
)
_NEUTRAL = {
    "top_p": 1.0,
    "min_p": 0.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "repetition_penalty": 1.0,
}


@dataclasses.dataclass
class SamplingValues:
    """The numeric settings of a batch's rows, on the device."""

    floats: torch.Tensor  # [rows, len(FLOAT_COLUMNS)] float32
    top_k: torch.Tensor  # [rows] int64, the vocabulary size where disabled


def row_values(params: SamplingParams, vocab_size: int) -> tuple[list[float], int]:
    """One row's FLOAT_COLUMNS values and its top-k as the filter reads it (the whole vocabulary
    when disabled, 0 or -1, or larger)."""
    top_k = vocab_size if params.top_k <= 0 else min(params.top_k, vocab_size)
    return [float(getattr(params, name)) for name in FLOAT_COLUMNS], top_k


def sampling_values(params: list[SamplingParams], vocab_size: int, device: torch.device) -> SamplingValues:
    """SamplingValues of a one-off batch, packed on the host and copied over."""
    rows = [row_values(p, vocab_size) for p in params]
    floats = np.array([values for values, _ in rows], dtype=np.float32).reshape(len(rows), len(FLOAT_COLUMNS))
    top_k = np.array([top_k for _, top_k in rows], dtype=np.int64)
    return SamplingValues(host_to_device(floats, device), host_to_device(top_k, device))


@dataclasses.dataclass
class SamplingMetadata:
    """Per-row sampling settings of one step's batch of logits; tensors live on the logits' device."""

    temperature: torch.Tensor  # [rows] float32; rows below GREEDY_TEMPERATURE are greedy
    all_greedy: bool
    top_k: torch.Tensor | None  # [rows] int64, vocab size where disabled; None when no row uses it
    top_p: torch.Tensor | None  # [rows] float32, 1 where disabled
    min_p: torch.Tensor | None  # [rows] float32, 0 where disabled
    # [rows] int64: a seeded random row's key (engine/sample/counter_random.py), 0 elsewhere;
    # None when no random row has a seed
    seed_keys: torch.Tensor | None
    seeded: torch.Tensor | None  # [rows] bool: the rows drawing from their seed_keys
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
    values: SamplingValues,
    prompt_token_ids: list[list[int]],
    output_token_ids: list[list[int]],
    seed_keys: list[int | None],
    eos_token_ids: list[int | None],
) -> SamplingMetadata:
    """Derive the batch's SamplingMetadata from each row's params, values, tokens, seed key and EOS.

    `seed_keys[row]` is the key of the row's draw, `position_seed(seed, output position)`, or None
    for a row without a seed; `eos_token_ids[row]` is the EOS that min_tokens holds back for that
    row (None: only its stop_token_ids). Filters are left out when every row is greedy, since
    argmax ignores them; a column is left out when no row moves it off its neutral value.
    """
    all_greedy = all(p.is_greedy for p in params)
    device = values.floats.device
    columns = {name: values.floats[:, index] for index, name in enumerate(FLOAT_COLUMNS)}

    def used(name: str, filters: bool = False) -> torch.Tensor | None:
        if (filters and all_greedy) or all(getattr(p, name) == _NEUTRAL[name] for p in params):
            return None
        return columns[name]

    # Greedy rows never draw noise, so their seeds are left out.
    seeded = [key is not None and not p.is_greedy for p, key in zip(params, seed_keys, strict=True)]
    keys = None
    if any(seeded):
        row_keys = as_int64_keys([key if draws else 0 for key, draws in zip(seed_keys, seeded, strict=True)])
        keys = host_to_device(np.array(row_keys, dtype=np.int64), device)
    return SamplingMetadata(
        temperature=columns["temperature"],
        all_greedy=all_greedy,
        top_k=None if all_greedy or all(p.top_k <= 0 for p in params) else values.top_k,
        top_p=used("top_p", filters=True),
        min_p=used("min_p", filters=True),
        seed_keys=keys,
        seeded=None if keys is None else host_to_device(np.array(seeded), device),
        presence_penalties=used("presence_penalty"),
        frequency_penalties=used("frequency_penalty"),
        repetition_penalties=used("repetition_penalty"),
        prompt_token_ids=prompt_token_ids,
        output_token_ids=output_token_ids,
        min_tokens=_min_tokens(params, output_token_ids, eos_token_ids),
        logit_bias={row: p.logit_bias for row, p in enumerate(params) if p.logit_bias},
        max_num_logprobs=max((p.logprobs for p in params if p.logprobs is not None), default=None),
    )


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
