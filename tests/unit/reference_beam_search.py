"""A plain beam search to compare the scheduler's against: transformers' algorithm transcribed over
the fake model of `scheduler_helpers` (`fake_logprobs`), with no blocks, batching or forking."""

from __future__ import annotations

from dataclasses import dataclass

from engine.outputs import FinishReason
from tests.unit.scheduler_helpers import VOCAB, TokenFn, fake_logprobs, logprobs_row


@dataclass
class ReferenceHypothesis:
    token_ids: list[int]
    cumulative_logprob: float
    score: float
    ended_by_eos: bool


_EXCLUDED = -1.0e9  # transformers' score for impossible beams


def _top(scores: list[float], count: int) -> list[int]:
    """Indices of the `count` best scores, best first; ties in index order (as merged)."""
    return sorted(range(len(scores)), key=lambda i: -scores[i])[:count]


def reference_beam_search(
    prompt: list[int],
    beam_width: int,
    max_tokens: int,
    eos_token_ids: set[int],
    length_penalty: float = 1.0,
    vocab: int = VOCAB,
) -> list[ReferenceHypothesis]:
    """transformers' `_beam_search` (do_sample=False, early_stopping=True, num_return_sequences =
    num_beams), transcribed slot by slot over `fake_logprobs`: `beam_width` running slots (all but the
    first starting at -1e9), the top 2k of slots x vocabulary, finished hypotheses merged into k
    slots with -1e9 masks, and its three stopping conditions."""
    k = beam_width
    running = [[] for _ in range(k)]
    running_scores = [0.0] + [_EXCLUDED] * (k - 1)
    finished: list[list[int]] = [[] for _ in range(k)]
    finished_scores = [_EXCLUDED] * k
    finished_logprobs = [0.0] * k
    is_sent_finished = [False] * k
    heuristic_unsatisfied = True
    generated = 0  # cur_len - decoder_prompt_len
    while True:
        # Accumulated log-probabilities of every (slot, token), and the top 2k of them.
        flat = [
            (running_scores[slot] + logprob, slot, token)
            for slot in range(k)
            for token, logprob in enumerate(fake_logprobs([*prompt, *running[slot]], vocab))
        ]
        top = [flat[i] for i in _top([entry[0] for entry in flat], 2 * k)]
        top_sequences = [[*running[slot], token] for _, slot, token in top]
        hits_stop = [generated + 1 >= max_tokens or token in eos_token_ids for _, _, token in top]
        # The running slots of the next iteration: the best k that did not stop.
        masked = [
            score + (_EXCLUDED if hit else 0.0) for (score, _, _), hit in zip(top, hits_stop, strict=True)
        ]
        chosen = _top(masked, k)
        next_running = [top_sequences[i] for i in chosen]
        next_scores = [masked[i] for i in chosen]
        # Update the finished slots with the top-k candidates that just stopped.
        just_finished = [hit and rank < k for rank, hit in enumerate(hits_stop)]
        full = all(is_sent_finished)
        scores = [
            score / (generated + 1) ** length_penalty
            + (_EXCLUDED if full else 0.0)
            + (0.0 if heuristic_unsatisfied else _EXCLUDED)
            + (0.0 if done else _EXCLUDED)
            for (score, _, _), done in zip(top, just_finished, strict=True)
        ]
        merged = _top(finished_scores + scores, k)
        all_sequences = finished + top_sequences
        all_logprobs = finished_logprobs + [score for score, _, _ in top]
        all_finished = is_sent_finished + just_finished
        all_scores = finished_scores + scores
        finished = [all_sequences[i] for i in merged]
        finished_logprobs = [all_logprobs[i] for i in merged]
        finished_scores = [all_scores[i] for i in merged]
        is_sent_finished = [all_finished[i] for i in merged]
        generated += 1
        # The early-stop heuristic, then transformers' three conditions to go on.
        best_possible = next_scores[0] / generated**length_penalty
        worst_finished = [min(finished_scores) if done else _EXCLUDED for done in is_sent_finished]
        heuristic_unsatisfied = heuristic_unsatisfied and any(best_possible > w for w in worst_finished)
        if not (heuristic_unsatisfied and not all(is_sent_finished) and not all(hits_stop)):
            break
        running, running_scores = next_running, next_scores
    return [
        ReferenceHypothesis(
            finished[i], finished_logprobs[i], finished_scores[i], finished[i][-1] in eos_token_ids
        )
        for i in range(k)
        if is_sent_finished[i]
    ]


def reference_sequence(
    seq_id: str,
    prompt: list[int],
    token_fn: TokenFn,
    *,
    max_tokens: int | None,
    eos_token_id: int | None,
    max_seq_len: int,
    vocab: int = VOCAB,
) -> tuple[list[int], FinishReason, float]:
    """What one sampled sequence must produce: (output tokens, finish reason, cumulative logprob)."""
    tokens, out, cumulative = list(prompt), [], 0.0
    while True:
        token = token_fn(seq_id, tokens)
        cumulative += logprobs_row(tokens, token, 0, vocab).logprobs[0][0]
        tokens.append(token)
        out.append(token)
        if eos_token_id is not None and token == eos_token_id:
            return out, FinishReason.STOP, cumulative
        if (max_tokens is not None and len(out) >= max_tokens) or len(tokens) >= max_seq_len:
            return out, FinishReason.LENGTH, cumulative
