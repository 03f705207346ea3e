"""Batched logits transformations, each [rows, vocab] float32 logits -> new logits.

None of them writes into its input: the caller's logits (and the raw logprobs taken from them)
stay as they were. Host-side lists reach the device through engine/transfers.py, without a wait.
"""

from __future__ import annotations

import itertools

import numpy as np
import torch

from engine.sample.metadata import SamplingMetadata
from engine.transfers import host_to_device


def apply_min_tokens(logits: torch.Tensor, min_tokens: dict[int, frozenset[int]]) -> torch.Tensor:
    """Mask (to -inf) the stop tokens of every row that has not yet generated its min_tokens."""
    if not min_tokens:
        return logits
    pairs = [(row, token) for row, tokens in min_tokens.items() for token in tokens]
    index = _pair_index(pairs, logits.device)
    return logits.index_put(index, logits.new_full((), float("-inf")))


def apply_logit_bias(logits: torch.Tensor, logit_bias: dict[int, dict[int, float]]) -> torch.Tensor:
    """Add each row's {token id: bias} to its logits."""
    if not logit_bias:
        return logits
    pairs = [(row, token) for row, biases in logit_bias.items() for token in biases]
    values = [bias for biases in logit_bias.values() for bias in biases.values()]
    bias = host_to_device(np.array(values, dtype=np.float32), logits.device).to(logits.dtype)
    return logits.index_put(_pair_index(pairs, logits.device), bias, accumulate=True)


def apply_penalties(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """vLLM's penalties, in its order: repetition, then frequency, then presence.

    Repetition counts tokens seen in the prompt or the output (a positive logit is divided by the
    penalty, a negative one multiplied, so both move down); frequency and presence, as in the
    OpenAI API, count only the output.
    """
    repetition, frequency, presence = (
        meta.repetition_penalties,
        meta.frequency_penalties,
        meta.presence_penalties,
    )
    if repetition is None and frequency is None and presence is None:
        return logits
    output_counts = token_counts(meta.output_token_ids, logits.shape[1], logits.device)
    if repetition is not None:
        seen = (output_counts > 0) | (token_counts(meta.prompt_token_ids, logits.shape[1], logits.device) > 0)
        penalty = torch.where(seen, repetition.unsqueeze(1), 1.0)
        logits = torch.where(logits > 0, logits / penalty, logits * penalty)
    if frequency is not None:
        logits = logits - frequency.unsqueeze(1) * output_counts
    if presence is not None:
        logits = logits - presence.unsqueeze(1) * (output_counts > 0)
    return logits


def token_counts(token_ids: list[list[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """[rows, vocab] float32: how often each token id occurs in each row's list (one scatter_add)."""
    lengths = np.array([len(tokens) for tokens in token_ids], dtype=np.int64)
    flat = np.fromiter(itertools.chain.from_iterable(token_ids), dtype=np.int64, count=int(lengths.sum()))
    # Row r's token t lands at r * vocab + t of the flattened [rows, vocab] counts.
    offsets = np.arange(len(token_ids), dtype=np.int64) * vocab_size
    index = host_to_device(flat + np.repeat(offsets, lengths), device)
    counts = torch.zeros(len(token_ids) * vocab_size, dtype=torch.float32, device=device)
    counts.scatter_add_(0, index, torch.ones(index.shape, dtype=torch.float32, device=device))
    return counts.view(len(token_ids), vocab_size)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask every token whose probability is below its row's min_p times the row's top probability."""
    probs = logits.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    return logits.masked_fill(probs < threshold, float("-inf"))


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


def _pair_index(pairs: list[tuple[int, int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, tokens) index tensors for index_put from a list of (row, token) pairs."""
    index = host_to_device(np.array(pairs, dtype=np.int64).reshape(-1, 2), device)
    return index[:, 0], index[:, 1]
