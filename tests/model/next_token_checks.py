"""Comparing two models' next-token choices position by position, on the same sequences, where
bf16 roundings or quantized activations may turn a near tie into another token."""

from __future__ import annotations

from engine import LLM, SamplingParams
from kernels.quant_linear import GEMV_MAX_ROWS

# Log-probability gap within which two tokens are a near tie: the logits are bf16, whose steps at
# the test models' logit sizes are 1/16, and two layouts' roundings differ by a few of them.
NEAR_TIE = 0.5
# Engine settings for a quantized model whose every step is at most GEMV_MAX_ROWS tokens, so that all
# its products quantize their activations to int8 as decoding does (a longer prefill chunk may take
# dequantized panels, the dense product up to rounding).
INT8_PATH_STEPS = {"max_num_batched_tokens": GEMV_MAX_ROWS, "max_num_seqs": 16}


def position_logprobs(llm: LLM, token_ids: list[list[int]]) -> list[list[dict]]:
    """The engine's 5 most likely next tokens (token id -> Logprob) after every prefix of each sequence."""
    params = SamplingParams(max_tokens=1, prompt_logprobs=5, temperature=0.0)
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in token_ids], params, use_tqdm=False)
    return [output.prompt_logprobs[1:] for output in outputs]


def best_token(position: dict) -> int:
    """The token of rank 1 among a position's log-probabilities."""
    return min(position, key=lambda token: position[token].rank)


def top_tokens(llm: LLM, token_ids: list[list[int]]) -> list[list[int]]:
    """The engine's most likely next token after every prefix of each sequence (from its prompt
    log-probabilities: the same prefixes for every model compared)."""
    return [[best_token(position) for position in sequence] for sequence in position_logprobs(llm, token_ids)]


def greedy_sequences(llm: LLM, prompts: list[str], max_tokens: int) -> list[list[int]]:
    """Each prompt's token ids followed by the engine's greedy continuation."""
    greedy = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outputs = llm.generate(prompts, greedy, use_tqdm=False)
    return [list(output.prompt_token_ids) + list(output.outputs[0].token_ids) for output in outputs]


def agreement_up_to_near_ties(
    reference: list[list[dict]], other: list[list[dict]], *, decided_only: bool = False
) -> float:
    """The share of positions where `other` picks `reference`'s top token; where it picks another,
    that token must be a near tie among `reference`'s top 5 (a misplaced weight would not be).
    `decided_only`: among the positions whose top two tokens `reference` does not tie exactly (its
    bf16 logits often do, and then its pick is the lower id, not the model's)."""
    pairs = [
        (a, b) for want, have in zip(reference, other, strict=True) for a, b in zip(want, have, strict=True)
    ]
    if decided_only:
        pairs = [(one, two) for one, two in pairs if not _top_two_tied(one)]
    agreeing = 0
    for one, two in pairs:
        best_one, best_two = best_token(one), best_token(two)
        agreeing += best_one == best_two
        if best_one != best_two:
            assert best_two in one and one[best_one].logprob - one[best_two].logprob <= NEAR_TIE, (one, two)
    return agreeing / len(pairs)


def _top_two_tied(position: dict) -> bool:
    first, second = sorted(position.values(), key=lambda logprob: logprob.rank)[:2]
    return first.logprob == second.logprob
